"""image/install.sh against a real debootstrapped Debian 11 arm64 root file system (with systemd), and the unit
checked by systemd's own `systemd-analyze verify` inside that root.

The root file system is built once by build/rootfs.sh (debootstrap under qemu user-mode emulation, a few
minutes) and cached under ~/.cache/kestrel-build; each test installs into a fresh copy. Needs root
(debootstrap, binfmt_misc), useradd and systemd-analyze on the host. The installed "binary" is the target's
own /bin/true: this file tests installation, the executable itself is tested by tests/system/test_frozen_*.py.
"""
from __future__ import annotations

import filecmp
import os
import re
import shutil
import stat
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE = os.path.join(REPO, "image")
CACHE = os.path.expanduser(os.environ.get("KESTREL_BUILD_CACHE", "~/.cache/kestrel-build"))
ROOTFS = os.path.join(CACHE, "rootfs-arm64-bullseye-systemd")
UNIT = "kestrel-appliance.service"


@pytest.fixture(scope="session")
def pristine_rootfs() -> str:
    subprocess.run(["bash", os.path.join(REPO, "build", "rootfs.sh"), "arm64", "bullseye", ROOTFS,
                    "systemd,systemd-sysv"], check=True)
    return ROOTFS


@pytest.fixture
def target(pristine_rootfs, tmp_path):
    root = str(tmp_path / "root")
    subprocess.run(["cp", "-a", pristine_rootfs, root], check=True)
    yield root
    shutil.rmtree(root)  # 230 MB each; pytest keeps the temporary directories of three sessions


def install(root: str, model: str, *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", os.path.join(IMAGE, "install.sh"), "--root", root, "--binary", os.path.join(root, "bin", "true"),
           "--model", model, "--model-name", "tiny-qwen3", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def read_env(path: str) -> dict[str, str]:
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                env[key] = value
    return env


def passwd_entry(root: str, db: str, name: str) -> list[str] | None:
    with open(os.path.join(root, "etc", db)) as f:
        for line in f:
            fields = line.rstrip("\n").split(":")
            if fields[0] == name:
                return fields
    return None


def verify(root: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", UNIT], capture_output=True, text=True)


def test_install_leaves_binary_unit_config_user_model_and_enablement(target, tiny_qwen3_tied):
    assert open(os.path.join(target, "etc", "os-release")).read().count('VERSION_ID="11"') == 1
    r = install(target, tiny_qwen3_tied, "--port", "8123", "--threads", "3")
    assert r.returncode == 0, r.stderr

    binary = os.path.join(target, "usr/local/bin/kestrel-appliance")
    assert filecmp.cmp(binary, os.path.join(target, "bin", "true"), shallow=False)
    assert stat.S_IMODE(os.stat(binary).st_mode) == 0o755
    assert filecmp.cmp(os.path.join(target, "etc/systemd/system", UNIT), os.path.join(IMAGE, UNIT), shallow=False)

    env = read_env(os.path.join(target, "etc/kestrel-appliance/appliance.env"))
    assert env == {"KESTREL_MODEL": "/var/lib/kestrel-appliance/models/tiny-qwen3", "KESTREL_HOST": "0.0.0.0",
                   "KESTREL_PORT": "8123", "KESTREL_THREADS": "3",
                   "KESTREL_API_KEY_FILE": "/etc/kestrel-appliance/api-key"}
    model = target + env["KESTREL_MODEL"]
    assert sorted(os.listdir(model)) == sorted(os.listdir(tiny_qwen3_tied))
    for name in os.listdir(model):
        assert filecmp.cmp(os.path.join(model, name), os.path.join(tiny_qwen3_tied, name), shallow=False)
        assert os.stat(os.path.join(model, name)).st_mode & 0o004  # readable by the service user

    user = passwd_entry(target, "passwd", "kestrel")
    group = passwd_entry(target, "group", "kestrel")
    assert user is not None and group is not None and passwd_entry(target, "shadow", "kestrel") is not None
    assert 0 < int(user[2]) < 1000 and user[3] == group[2]  # a system account with its own group
    assert user[6] == "/usr/sbin/nologin" and os.path.exists(target + user[6])

    key = target + env["KESTREL_API_KEY_FILE"]
    st = os.stat(key)
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == 0 and st.st_gid == int(group[2])
    assert len(open(key).read().strip()) >= 24

    link = os.path.join(target, "etc/systemd/system/multi-user.target.wants", UNIT)
    assert os.readlink(link) == "/etc/systemd/system/" + UNIT
    enabled = subprocess.run(["systemctl", f"--root={target}", "is-enabled", UNIT], capture_output=True, text=True)
    assert enabled.stdout.strip() == "enabled", enabled

    r = verify(target)
    assert r.returncode == 0 and UNIT not in r.stdout + r.stderr, r.stdout + r.stderr


def test_verify_rejects_the_unit_when_the_binary_is_missing(target, tiny_qwen3_tied):
    assert install(target, tiny_qwen3_tied).returncode == 0
    os.remove(os.path.join(target, "usr/local/bin/kestrel-appliance"))
    r = verify(target)
    assert r.returncode != 0 and "kestrel-appliance" in r.stderr, r.stderr


def test_rerun_keeps_edited_settings_and_key(target, tiny_qwen3_tied, tmp_path):
    assert install(target, tiny_qwen3_tied).returncode == 0
    conf = os.path.join(target, "etc/kestrel-appliance")
    with open(os.path.join(conf, "appliance.env"), "a") as f:
        f.write("KESTREL_PORT=9999\n")
    key = open(os.path.join(conf, "api-key")).read()
    before = passwd_entry(target, "passwd", "kestrel")
    r = install(target, tiny_qwen3_tied)
    assert r.returncode == 0, r.stderr
    assert read_env(os.path.join(conf, "appliance.env"))["KESTREL_PORT"] == "9999"
    assert read_env(os.path.join(conf, "appliance.env.new"))["KESTREL_PORT"] == "8080"
    assert open(os.path.join(conf, "api-key")).read() == key
    assert passwd_entry(target, "passwd", "kestrel") == before
    assert sum(1 for line in open(os.path.join(target, "etc/passwd")) if line.startswith("kestrel:")) == 1


def test_given_api_key_file_is_installed(target, tiny_qwen3_tied, tmp_path):
    given = tmp_path / "key"
    given.write_text("sk-board-7\n")
    assert install(target, tiny_qwen3_tied, "--api-key-file", str(given)).returncode == 0
    assert open(os.path.join(target, "etc/kestrel-appliance/api-key")).read() == "sk-board-7\n"


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "model /nonexistent/model not found"),
    (["--port", "http"], "--port must be a number"),
    (["--bogus"], "unknown option --bogus"),
])
def test_bad_arguments_give_one_line_errors(target, tiny_qwen3_tied, args, message):
    r = install(target, tiny_qwen3_tied, *args)
    assert r.returncode != 0 and message in r.stderr.splitlines()[0], r.stderr
    assert not os.path.exists(os.path.join(target, "usr/local/bin/kestrel-appliance"))


def test_not_a_root_file_system(tmp_path, tiny_qwen3_tied):
    r = install(str(tmp_path), tiny_qwen3_tied)
    assert r.returncode == 1 and r.stderr.strip() == f"install.sh: {tmp_path} does not look like a root file system (no etc/)"


def test_unit_settings_come_from_the_config_file():
    """Every ${VAR} the unit's ExecStart uses is set by the shipped appliance.env."""
    unit = open(os.path.join(IMAGE, UNIT)).read()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    used = set(re.findall(r"\$\{(\w+)\}", exec_start))
    assert used == set(read_env(os.path.join(IMAGE, "appliance.env")))


def test_sysusers_entry_describes_the_account_install_made(target, tiny_qwen3_tied, tmp_path):
    """The shipped sysusers.d entry (for images whose /etc is reset) makes the same account useradd made."""
    assert install(target, tiny_qwen3_tied).returncode == 0
    conf = os.path.join(target, "usr/lib/sysusers.d/kestrel-appliance.conf")
    assert filecmp.cmp(conf, os.path.join(IMAGE, "kestrel-appliance.sysusers"), shallow=False)
    made = passwd_entry(target, "passwd", "kestrel")
    r = subprocess.run(["systemd-sysusers", f"--root={target}", "kestrel-appliance.conf"],  # found in the root
                       capture_output=True, text=True)
    assert r.returncode == 0 and "kestrel" not in r.stdout + r.stderr, r  # already there: nothing to do
    assert passwd_entry(target, "passwd", "kestrel") == made
    fresh = str(tmp_path / "fresh")
    subprocess.run(["cp", "-a", ROOTFS, fresh], check=True)
    try:
        r = subprocess.run(["systemd-sysusers", f"--root={fresh}", conf], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert passwd_entry(fresh, "passwd", "kestrel")[4:] == made[4:]  # same comment, home and shell
    finally:
        shutil.rmtree(fresh)


def test_the_kiosk_is_off_by_default_and_installed_with_kiosk(target, tiny_qwen3_tied):
    kiosk = "kestrel-kiosk.service"
    assert install(target, tiny_qwen3_tied).returncode == 0
    assert not os.path.exists(os.path.join(target, "etc/systemd/system", kiosk))
    assert passwd_entry(target, "passwd", "kestrel-kiosk") is None

    r = install(target, tiny_qwen3_tied, "--kiosk")
    assert r.returncode == 0, r.stderr
    assert "cage and chromium" in r.stderr  # this root has neither: said, not fatal
    assert filecmp.cmp(os.path.join(target, "etc/systemd/system", kiosk), os.path.join(IMAGE, kiosk), shallow=False)
    user = passwd_entry(target, "passwd", "kestrel-kiosk")
    assert user is not None and 0 < int(user[2]) < 1000 and user[5] == "/var/lib/kestrel-kiosk"
    home = os.stat(target + user[5])
    assert home.st_uid == int(user[2]) and stat.S_IMODE(home.st_mode) == 0o700  # the browser profile lives here
    video = passwd_entry(target, "group", "video")
    assert video is not None and "kestrel-kiosk" in video[3].split(",")
    enabled = subprocess.run(["systemctl", f"--root={target}", "is-enabled", kiosk], capture_output=True, text=True)
    assert enabled.stdout.strip() == "enabled", enabled
    assert os.readlink(os.path.join(target, "etc/systemd/system/default.target")).endswith("/graphical.target")
    # systemd's own check of the unit, with stand-ins for the two programs the board image must bring
    for exe in ("usr/bin/cage", "usr/bin/chromium"):
        shutil.copy2(os.path.join(target, "bin", "true"), os.path.join(target, exe))
    r = subprocess.run(["systemd-analyze", "verify", f"--root={target}", kiosk], capture_output=True, text=True)
    assert r.returncode == 0 and kiosk not in r.stdout + r.stderr, r.stdout + r.stderr
    # the page the kiosk opens is the appliance's own port from appliance.env
    unit = open(os.path.join(IMAGE, kiosk)).read()
    assert re.search(r"^ExecStart=/usr/bin/cage -s -- /usr/bin/chromium --kiosk .* http://127\.0\.0\.1:\$\{KESTREL_PORT\}/$",
                     unit, re.M)
    assert "KESTREL_PORT" in read_env(os.path.join(target, "etc/kestrel-appliance/appliance.env"))
