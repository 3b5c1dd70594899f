"""Command line: `kestrel-appliance --model PATH` serves; `--prompt "..."` answers once on stdout and exits.

Policies:
- User mistakes (missing or unreadable model path, unsupported model, port in use, bad key file) end with one
  `kestrel-appliance: error: ...` line on stderr and a non-zero exit, never a traceback (status 2 for a model
  file whose content is refused, naming the file, the tensor or key and the problem: invalid, inconsistent,
  or a tensor type the kernels do not serve; 1 otherwise).
- Serving binds first (so /health answers 503 "Loading model" while the model loads, as does every request that
  needs the model) and starts the server's GIL-free busy responder (h11_server.answer_while_busy), which answers
  any connection the event loop leaves waiting with the same 503 until the model is loaded (or has failed).
  The load's first part, which holds the GIL in native calls for up to seconds (the tokenizers library's BPE
  build, llguidance's grammar table), runs before the event loop exists (_read_ahead): meanwhile the responder
  answers everything, and so the loop, once it runs, is never held by the load (its lag stays that of the
  machine). The rest (layers, caches, warm-up) runs on the engine thread beside the loop. Under systemd
  (Type=notify) READY=1 goes out once the model is loaded, WATCHDOG=1 pings come from the busy responder's
  thread until the loop runs and from the event loop from then on, STOPPING=1 at the first signal (one during
  the load's first part ends the process, exit 0, once the native call it meets returns).
- SIGTERM/SIGINT: stop accepting, send queued requests away (503 server_shutdown), let running ones finish
  within --grace seconds, then end them with a `server_shutdown` error (streams: an error event and the end
  of the body), exit 0 within grace + 2 s. If the engine thread is still inside a native call by then, the
  process ends with os._exit: finalizing the interpreter would unmap the weights under that call. A second
  signal cancels at once.
- The cyclic garbage collector is off from argument parsing until the model is loaded (start_done).
- --threads sizes the C kernels' pool and caps the BLAS/OpenMP pools (set before numpy is imported, so heavy
  imports happen inside the functions here, after argument parsing).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

from .version import version

PROG = "kestrel-appliance"
ENGINE_STOP_S = 0.5   # after the last connection: how long the engine thread gets to leave its computation
log = logging.getLogger("appliance")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status `status` (1; 2 for a model file whose content is
    refused)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def load_failure_status(err: BaseException | None) -> int:
    from .engine.load import ModelFileError
    return 2 if isinstance(err, ModelFileError) else 1


class VersionAction(argparse.Action):
    """--version, the version looked up only when asked (importlib.metadata costs ~50 ms of every start)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{PROG} {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="OpenAI-compatible Qwen3 inference service.",
                                epilog="Convert a Hugging Face checkpoint to GGUF: %(prog)s convert HF_DIR OUT.gguf "
                                       "--type q8_0|q4_0|f16|f32 (see %(prog)s convert --help). An nginx "
                                       "configuration for several boards: %(prog)s fleet-config --board HOST:PORT "
                                       "... (see %(prog)s fleet-config --help).")
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--model", metavar="PATH", required=True, help="Hugging Face model directory or .gguf file")
    s = p.add_argument_group("serving")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    keys = s.add_mutually_exclusive_group()
    keys.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY'")
    keys.add_argument("--api-key-file", metavar="FILE", help="read the key(s) from FILE, one per line")
    s.add_argument("--cors-origins", default="", metavar="LIST",
                   help="comma list of scheme://host[:port|:*] origins whose pages may call the API, beyond the "
                        "appliance's own page and loopback pages; '*' allows every origin")
    s.add_argument("--allowed-hosts", default="", metavar="LIST",
                   help="comma list of Host names the server answers to, beyond its addresses and localhost "
                        "(a reverse proxy's public name; DNS rebinding defence); '*' turns the check off")
    s.add_argument("--queue", type=int, default=4, metavar="N", help="requests that may wait (default 4)")
    s.add_argument("--ctx", type=int, metavar="N",
                   help="context length in tokens (default: the model's trained context, capped so a full KV cache "
                        "takes at most half the available memory; printed at start)")
    s.add_argument("--kv-type", choices=["f16", "f32"],
                   help="KV cache element type (default f16: half the memory of f32; f32 for embedding models "
                        "and rerankers)")
    s.add_argument("--cache-ram", type=int, metavar="MB",
                   help="memory for the KV of the active and earlier conversations kept for prefix reuse "
                        "(default: a quarter of the memory available at start; 0 keeps only the active one)")
    s.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="keep the KV of prompt prefixes that requests share (e.g. the system prompt) in DIR, so the "
                        "first request after a restart is warm")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt from scratch (no KV reuse across requests)")
    s.add_argument("--spec", choices=["auto", "ngram", "mtp", "none"], default="auto",
                   help="speculative decoding: auto (default): the model's MTP head if its checkpoint has one "
                        "(Qwen3.5), else ngram; ngram: drafts looked up in the prompt and output; mtp; none")
    s.add_argument("--draft-model", "-md", metavar="PATH",
                   help="speculative decoding from this smaller model (Hugging Face directory or .gguf; the model's "
                        "tokenizer), instead of drafts from the prompt")
    s.add_argument("--draft-max", type=int, default=8, metavar="N", help="drafted tokens per verify, at most (8)")
    s.add_argument("--draft-min", type=int, default=1, metavar="N", help="drafted tokens per verify, at least (1)")
    s.add_argument("--threads", type=int, metavar="N", help="threads of the C kernels' pool (big cores first); also caps BLAS/OpenMP pools")
    s.add_argument("--prefill-chunk", type=int, default=256, metavar="N", help="prompt tokens per prefill step")
    s.add_argument("--moe-release-pages", action="store_true",
                   help="mixture-of-experts models: give each expert's weight pages back to the kernel after use, "
                        "so resident memory stays well under the file size (slower when experts repeat)")
    s.add_argument("--no-web", action="store_true",
                   help="do not serve the built-in chat page at / and /chat/ (headless deployments)")
    s.add_argument("--max-resident", type=int, metavar="MB",
                   help="dense models: keep at most MB MiB of the model file's weights resident, releasing a "
                        "layer's pages after it ran (a model larger than free memory runs, slower)")
    s.add_argument("--extension-events", action="store_true",
                   help="send the chat.completion.metrics / .tokens events on every stream by default")
    s.add_argument("--image-dir", action="append", default=[], metavar="DIR",
                   help="allow image_url file paths under DIR (repeatable; default: data: URIs only)")
    p.add_argument("--mmproj", metavar="PATH",
                   help="a Qwen3-VL .gguf text model's vision projector (llama.cpp's mmproj-*.gguf; default: the "
                        "one mmproj*.gguf beside the model, if there is exactly one)")
    s.add_argument("--image-max-pixels", type=int, metavar="N",
                   help="resize images to at most N pixels (default: the model's preprocessor_config.json)")
    s.add_argument("--board-name", metavar="NAME",
                   help="this board's name, sent as X-Kestrel-Board on every response (default: the host name)")
    task = s.add_mutually_exclusive_group()
    task.add_argument("--embedding", "--embeddings", action="store_true",
                      help="serve embeddings (/v1/embeddings, /api/embed) from this model; embedding models "
                           "(Qwen3-Embedding, a GGUF with pooling_type) are recognised without it")
    task.add_argument("--reranking", "--rerank", action="store_true",
                      help="serve /v1/rerank with this model as a Qwen3-Reranker (yes/no scores)")
    s.add_argument("--pooling", choices=["last", "mean", "cls"],
                   help="an embedding model's pooling (default: the checkpoint's, else last)")
    s.add_argument("--grace", type=float, default=10.0, metavar="S", help="shutdown grace period (seconds)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    o = p.add_argument_group("one-shot")
    o.add_argument("--prompt", help="answer this prompt on stdout, token by token, and exit")
    o.add_argument("--system", help="system prompt for --prompt")
    o.add_argument("--max-tokens", type=int, metavar="N")
    o.add_argument("--temperature", type=float)
    o.add_argument("--seed", type=int)
    o.add_argument("--no-think", action="store_true", help="render the template with enable_thinking=false")
    return p


def _positive(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for d in args.image_dir:
        if not os.path.isdir(d):
            p.error(f"--image-dir {d} is not a directory")
    for name in ("ctx", "threads", "prefill_chunk", "max_tokens", "image_max_pixels", "max_resident", "draft_max",
                 "draft_min"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.draft_min > args.draft_max:
        p.error("--draft-min must not exceed --draft-max")
    if args.draft_model is not None and args.spec == "none":
        p.error("--draft-model drafts for speculative decoding, which --spec none turns off")
    if args.cache_ram is not None and args.cache_ram < 0:
        p.error("--cache-ram must be at least 0")
    if args.queue < 0:
        p.error("--queue must be at least 0")
    if not 0 <= args.port <= 65535:
        p.error("--port must be between 0 and 65535")
    from .protocol.browser_policy import parse_host_list, parse_origin_rules
    try:
        parse_origin_rules(args.cors_origins)
        parse_host_list(args.allowed_hosts)
    except ValueError as e:
        p.error(str(e))
    if args.board_name is not None:
        from .protocol.board import board_name_problem
        problem = board_name_problem(args.board_name)
        if problem is not None:
            p.error(f"--board-name {problem}")


def _check_model_path(path: str, what: str = "model path") -> None:
    if not os.path.exists(path):
        raise CliError(f"{what} does not exist: {path}")
    if not os.access(path, os.R_OK) or (os.path.isdir(path) and not os.access(path, os.X_OK)):
        raise CliError(f"{what} is not readable: {path}")


def _check_prompt_cache_dir(path: str | None) -> None:
    if path is not None and os.path.lexists(path) and not os.path.isdir(path):
        raise CliError(f"--prompt-cache-dir {path} is not a directory")


def _read_keys(args: argparse.Namespace) -> tuple[str, ...]:
    if args.api_key is not None:
        if not args.api_key.strip():
            raise CliError("--api-key is empty")
        return (args.api_key.strip(),)
    if args.api_key_file is None:
        return ()
    try:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read --api-key-file {args.api_key_file}: {getattr(e, 'strerror', None) or e}") from e
    if not keys:
        raise CliError(f"--api-key-file {args.api_key_file} holds no key")
    return keys


def load_options(args: argparse.Namespace):
    """The load-time flags as one LoadOptions."""
    from .engine.load import LoadOptions
    from .engine.speculative import SpecOptions
    return LoadOptions(spec=SpecOptions(args.spec, args.draft_max, args.draft_min), context_length=args.ctx,
                       prefill_chunk=args.prefill_chunk, threads=args.threads,
                       kv_type=args.kv_type or "f16", kv_type_given=args.kv_type is not None,
                       cache_ram_mb=args.cache_ram, prefix_reuse=not args.no_prefix_cache,
                       prompt_cache_dir=args.prompt_cache_dir,
                       moe_release_pages=args.moe_release_pages, image_max_pixels=args.image_max_pixels,
                       max_resident_mib=args.max_resident, mmproj=args.mmproj,
                       task="embedding" if args.embedding else "rerank" if args.reranking else None,
                       pooling=args.pooling, draft_model=args.draft_model)


def _read(args: argparse.Namespace):
    """The first part of the load (engine/load.read_model): the checkpoint read and checked, its tokenizer
    built."""
    from .engine.load import read_model
    from .engine.load.phases import process_age
    began = process_age()
    read = read_model(args.model, load_options(args))
    read.phases.began_at_age = began
    return read


def _grammar_table(read) -> None:
    """A generative model's structured-output table (work that holds the GIL, done while /health says loading
    rather than in the first request that needs it)."""
    if read.generates:  # embedding models and rerankers have no output constraints
        from .engine.constraint import build_grammar_tokenizer
        from .native.busy_responder import GIL_BOUND
        ckpt = read.checkpoint
        with GIL_BOUND.section("grammar table"):  # llguidance holds the GIL throughout
            build_grammar_tokenizer(ckpt.tokenizer, ckpt.model.config.vocab_size, ckpt.eos_ids)
        read.phases.mark("grammar table")


def _finish(read):
    """The rest of the load: layers, caches, the Engine, warmed up."""
    from .engine.load import finish_model
    loaded = finish_model(read)
    loaded.engine.warm_up()
    loaded.phases.mark("warm-up")
    return loaded


def _load(args: argparse.Namespace, serving: bool = False):
    """The model, warmed up; for serving also its structured-output table."""
    read = _read(args)
    if serving:
        _grammar_table(read)
    return _finish(read)


class _Signalled(BaseException):
    """SIGTERM / SIGINT while the load's first part runs before the event loop (_read_ahead)."""


def _read_ahead(args: argparse.Namespace, ahead: dict) -> str | None:
    """The load's GIL-bound part (the read with its tokenizer build, the grammar table) in this thread before
    the event loop exists: ahead["read"], or ahead["error"] for the engine thread to raise. A SIGTERM or SIGINT
    meanwhile ends it (once the native call it interrupts returns); returns that signal's name."""
    got: list[str] = []
    armed = [True]

    def on_signal(sig, frame) -> None:
        got.append(signal.Signals(sig).name)
        if armed[0]:
            raise _Signalled()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            read = _read(args)
            _grammar_table(read)
            ahead["read"] = read
        except _Signalled:
            pass
        except Exception as e:  # the engine thread raises it: reported as any load failure (on_loaded)
            ahead["error"] = e
        armed[0] = False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return got[0] if got else None


def start_done() -> None:
    """The start is over: the cyclic garbage collector back on, with everything the start made (modules, the
    model, the tables) frozen out of its passes. During the start it is off: imports and the load make millions
    of objects and almost no cycles, and its passes over them cost ~10% of the time to ready."""
    gc.freeze()
    gc.enable()


def board_name(given: str | None) -> str:
    """--board-name, else the host name (its first 64 visible characters; none if it has none)."""
    if given is not None:
        return given
    import socket
    return "".join(c for c in socket.gethostname() if "!" <= c <= "~")[:64]


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- one-shot -------------------------------------------------------------------------------------------

def run_prompt(args: argparse.Namespace) -> int:
    from .engine.generate import FinishEvent, GenerationRequest
    from .engine.load import ModelLoadError
    from .engine.sampling import SamplingParamError, SamplingParams

    try:
        loaded = _load(args)
    except ModelLoadError as e:
        raise CliError(str(e), load_failure_status(e)) from None
    if loaded.kind != "generate":
        raise CliError(f"--prompt needs a text generation model; {loaded.name} is {loaded.task.description}")
    start_done()
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    kwargs = {"enable_thinking": False} if args.no_think else {}
    try:
        prompt = loaded.chat_template.render(messages, add_generation_prompt=True, **kwargs)
        sampling = SamplingParams.from_generation_config(loaded.default_sampling, temperature=args.temperature,
                                                         seed=args.seed)
    except (SamplingParamError, ValueError) as e:
        raise CliError(str(e)) from None
    ids = loaded.tokenizer.encode(prompt)
    if args.max_tokens is not None and len(ids) + args.max_tokens > loaded.context_length:
        raise CliError(f"the prompt ({len(ids)} tokens) plus --max-tokens {args.max_tokens} exceeds the context "
                       f"length {loaded.context_length}")
    req = GenerationRequest(prompt_ids=ids, sampling=sampling, max_tokens=args.max_tokens)
    out = sys.stdout.buffer
    try:
        for ev in loaded.engine.generate(req):
            out.write(ev.text.encode("utf-8"))
            if isinstance(ev, FinishEvent):
                out.write(b"\n")
            out.flush()
    except ValueError as e:  # ContextLengthError
        raise CliError(str(e)) from None
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


# ---- serving --------------------------------------------------------------------------------------------

def serve(args: argparse.Namespace, keys: tuple[str, ...]) -> int:
    """Bind, answer 503 Loading model from the busy responder's thread (which also feeds systemd's watchdog),
    run the load's GIL-bound part (_read_ahead) before the event loop exists, then the loop, with the rest of
    the load on the engine thread. Without the native library (no busy responder) the whole load runs on the
    engine thread, beside the loop."""
    import trio

    from . import systemd
    from .engine.load import model_name
    from .h11_server import HttpServer, ServerConfig
    from .server.app import Api, ApiConfig, loading_response
    from .server.worker import Worker

    ahead: dict = {}

    def load():
        if "error" in ahead:
            raise ahead["error"]
        return _finish(ahead["read"]) if "read" in ahead else _load(args, serving=True)

    worker = Worker(load=load, queue_limit=args.queue)
    api = Api(worker, ApiConfig(model_name=model_name(args.model), api_keys=keys,
                                extension_events=args.extension_events, image_dirs=tuple(args.image_dir),
                                web=not args.no_web, cors_origins=args.cors_origins,
                                allowed_hosts=args.allowed_hosts, listen_host=args.host))
    server = HttpServer(ServerConfig(host=args.host, port=args.port, grace_period=args.grace,
                                     board_name=board_name(args.board_name)), api)
    try:
        server.bind()
    except OSError as e:
        raise CliError(e.strerror or str(e)) from None
    if not server.answer_while_busy(*loading_response()):
        log.info("no native library: while the model loads, only the event loop answers")
    interval, address = systemd.watchdog_interval(), systemd.notify_address()
    if server.busy_answers and interval is not None and address is not None:
        server.busy_watchdog(address, interval)
    log.info("listening on %s", ", ".join(f"http://{host_port(args.host, p)}" for p in server.ports))
    if server.busy_answers:
        signalled = _read_ahead(args, ahead)
        if signalled is not None:
            log.info("%s during the load: shutting down", signalled)
            systemd.notify_stopping(f"{signalled} during the load")
            server.close_now()
            return 0
    return trio.run(serve_loop, args, worker, api, server)


async def serve_loop(args: argparse.Namespace, worker, api, server) -> int:
    """The event loop's part of serving: signals, the rest of the load, readiness, the watchdog, requests."""
    import trio

    from . import systemd
    from .engine.load import model_name
    from .engine.load.phases import startup_line

    status = 0
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            async def on_signals() -> None:
                async for sig in signals:
                    if server.closing:
                        log.warning("second signal: cancelling everything")
                        nursery.cancel_scope.cancel()
                        return
                    log.info("%s: shutting down (grace %.0f s)", signal.Signals(sig).name, args.grace)
                    systemd.notify_stopping(f"{signal.Signals(sig).name}: finishing in-flight requests")
                    worker.close_queue()
                    nursery.start_soon(server.shutdown)

            async def on_loaded() -> None:
                nonlocal status
                await worker.ready.wait()
                answered = await server.stop_busy_answers()
                if answered:
                    log.info("%d connection(s) got 503 Loading model while the load held the interpreter", answered)
                if worker.state == "failed":
                    err = worker.load_error
                    print(f"{PROG}: error: {err}" if str(err) else f"{PROG}: error: {err!r}", file=sys.stderr)
                    status = load_failure_status(err)
                    await server.shutdown(0)
                else:
                    loaded = worker.loaded
                    assert loaded is not None  # the state is "ready"
                    log.info("model %s ready (context %d tokens)", model_name(args.model), loaded.context_length)
                    log.info("%s", startup_line(loaded.phases))
                    start_done()
                    systemd.notify_ready(f"serving {model_name(args.model)} on "
                                         + ", ".join(host_port(args.host, p) for p in server.ports))

            async def watchdog() -> None:  # pings prove the event loop itself is alive
                interval = systemd.watchdog_interval()
                if interval is not None:
                    systemd.notify_watchdog()
                    server.busy_watchdog(None)  # the busy responder's thread pinged until now
                while interval is not None:
                    await trio.sleep(interval)
                    systemd.notify_watchdog()

            nursery.start_soon(on_signals)
            nursery.start_soon(on_loaded)
            nursery.start_soon(watchdog)
            nursery.start_soon(api.loop_lag.run)
            await worker.start()
            await server.serve()
            nursery.cancel_scope.cancel()
    worker.stop(timeout=ENGINE_STOP_S)
    if worker.engine_alive():
        log.warning("the engine is still inside a computation; exiting without interpreter teardown")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "convert":  # `kestrel-appliance convert HF_DIR OUT.gguf --type q8_0|q4_0|f16`
        from .convert import main as convert_main
        return convert_main(argv[1:])
    if argv and argv[0] == "fleet-config":  # `kestrel-appliance fleet-config --board HOST:PORT ...`: nginx config
        from .fleet import main as fleet_main
        return fleet_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _positive(parser, args)
    if args.threads:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "KESTREL_THREADS"):
            os.environ[var] = str(args.threads)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gc.disable()  # until the model is loaded (start_done)
    try:
        _check_model_path(args.model)
        if args.draft_model is not None:
            _check_model_path(args.draft_model, "--draft-model path")
        _check_prompt_cache_dir(args.prompt_cache_dir)
        if args.prompt is not None:
            return run_prompt(args)
        keys = _read_keys(args)
        return serve(args, keys)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        return 130
    finally:
        gc.enable()


if __name__ == "__main__":
    sys.exit(main())
