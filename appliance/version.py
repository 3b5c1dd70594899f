"""The installed package's version (for --version, /props and the Ollama API)."""


def version() -> str:
    try:
        from importlib.metadata import version as dist_version
        return dist_version("kestrel-appliance")
    except Exception:
        return "0+unknown"
