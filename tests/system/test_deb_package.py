"""build/deb.sh: the Debian package installed, upgraded and purged with the target's own dpkg inside a
debootstrapped Debian 11 arm64 root file system (under qemu user-mode emulation: the maintainer scripts run
the root's own sh, getent, systemd-sysusers and deb-systemd-helper), and its unit checked by
`systemd-analyze verify`.

The root file system is tests/system/test_image_install.py's (build/rootfs.sh, cached). The packaged executable is the
target's own /bin/true, as in test_image_install: this file tests packaging and the maintainer scripts; the
executable itself is tested by tests/system/test_frozen_smoke.py (scripts/test.sh also packages the real aarch64 build).
"""
from __future__ import annotations

import filecmp
import os
import shutil
import subprocess

import pytest

from tests.system.test_image_install import passwd_entry, pristine_rootfs, read_env, target, verify  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = "kestrel-appliance"
UNIT = f"{PKG}.service"


@pytest.fixture
def root(target):  # noqa: F811 (the fixture imported above)
    """A fresh copy of the Debian 11 arm64 root (test_image_install's `target`)."""
    return target


def make_deb(root: str, out: str, version: str = "0.1.0") -> str:
    r = subprocess.run(["bash", os.path.join(REPO, "build", "deb.sh"), "--arch", "arm64", "--binary",
                        os.path.join(root, "bin", "true"), "--version", version, "--out", out, "--libc", "2.30"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    deb = r.stdout.strip()
    assert os.path.basename(deb) == f"{PKG}_{version}_arm64.deb" and os.path.isfile(deb)
    return deb


def in_root(root: str, *cmd: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "QEMU_CPU": "cortex-a76"}
    return subprocess.run(["chroot", root, *cmd], capture_output=True, text=True, env=env, timeout=600)


def test_package_fields_and_contents(root, tmp_path):
    deb = make_deb(root, str(tmp_path))
    info = subprocess.run(["dpkg-deb", "--field", deb], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line and not line.startswith(" "))
    assert fields["Package"] == PKG and fields["Version"] == "0.1.0" and fields["Architecture"] == "arm64"
    assert "libc6 (>= 2.30)" in fields["Depends"]
    files = subprocess.run(["dpkg-deb", "--contents", deb], capture_output=True, text=True, check=True).stdout
    paths = {line.split()[-1].lstrip(".") for line in files.splitlines()}
    for p in ("/usr/bin/kestrel-appliance", f"/lib/systemd/system/{UNIT}", f"/usr/lib/sysusers.d/{PKG}.conf",
              "/etc/kestrel-appliance/appliance.env"):
        assert p in paths, files
    conffiles = subprocess.run(["dpkg-deb", "--info", deb, "conffiles"], capture_output=True, text=True, check=True)
    assert conffiles.stdout.split() == ["/etc/kestrel-appliance/appliance.env"]


def test_install_enables_without_starting_upgrade_keeps_edits_purge_keeps_only_models(root, tmp_path,
                                                                                      tiny_qwen3_tied):
    assert not os.path.exists(os.path.join(root, "run/systemd/system"))  # a chroot: nothing may start
    deb = make_deb(root, str(tmp_path))
    shutil.copy(deb, os.path.join(root, "tmp", "k.deb"))
    r = in_root(root, "dpkg", "-i", "/tmp/k.deb")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "generated an API key" in r.stderr

    binary = os.path.join(root, "usr/bin/kestrel-appliance")
    assert filecmp.cmp(binary, os.path.join(root, "bin/true"), shallow=False)
    unit = open(os.path.join(root, "lib/systemd/system", UNIT)).read()
    assert "ExecStart=/usr/bin/kestrel-appliance --model ${KESTREL_MODEL}" in unit
    user, group = passwd_entry(root, "passwd", "kestrel"), passwd_entry(root, "group", "kestrel")
    assert user is not None and group is not None and 0 < int(user[2]) < 1000 and user[3] == group[2]
    assert user[5:] == ["/var/lib/kestrel-appliance", "/usr/sbin/nologin"]
    key = os.path.join(root, "etc/kestrel-appliance/api-key")
    st = os.stat(key)
    assert oct(st.st_mode & 0o777) == "0o640" and st.st_uid == 0 and st.st_gid == int(group[2])
    env = read_env(os.path.join(root, "etc/kestrel-appliance/appliance.env"))
    assert env["KESTREL_MODEL"] == "/var/lib/kestrel-appliance/models/default"
    assert env["KESTREL_API_KEY_FILE"] == "/etc/kestrel-appliance/api-key"
    link = os.path.join(root, "etc/systemd/system/multi-user.target.wants", UNIT)
    assert os.readlink(link) == f"/lib/systemd/system/{UNIT}"
    enabled = subprocess.run(["systemctl", f"--root={root}", "is-enabled", UNIT], capture_output=True, text=True)
    assert enabled.stdout.strip() == "enabled", enabled
    v = verify(root)
    assert v.returncode == 0 and UNIT not in v.stdout + v.stderr, v.stdout + v.stderr
    status = in_root(root, "dpkg-query", "-W", "-f=${Status} ${Version}", PKG)
    assert status.stdout == "install ok installed 0.1.0", status

    # the user's settings, key and model; an upgrade keeps all three
    models = os.path.join(root, "var/lib/kestrel-appliance/models")
    shutil.copytree(tiny_qwen3_tied, os.path.join(models, "default"))
    with open(os.path.join(root, "etc/kestrel-appliance/appliance.env"), "a") as f:
        f.write("KESTREL_PORT=9999\n")
    issued = open(key).read()
    deb2 = make_deb(root, str(tmp_path / "v2"), "0.1.1")
    shutil.copy(deb2, os.path.join(root, "tmp", "k2.deb"))
    r = in_root(root, "dpkg", "--force-confold", "-i", "/tmp/k2.deb")
    assert r.returncode == 0, r.stdout + r.stderr
    assert read_env(os.path.join(root, "etc/kestrel-appliance/appliance.env"))["KESTREL_PORT"] == "9999"
    assert open(key).read() == issued and passwd_entry(root, "passwd", "kestrel") == user
    assert os.readlink(link) == f"/lib/systemd/system/{UNIT}"

    r = in_root(root, "dpkg", "--purge", PKG)
    assert r.returncode == 0, r.stdout + r.stderr
    for gone in ("usr/bin/kestrel-appliance", f"lib/systemd/system/{UNIT}", f"usr/lib/sysusers.d/{PKG}.conf",
                 "etc/kestrel-appliance", f"etc/systemd/system/multi-user.target.wants/{UNIT}",
                 f"var/lib/systemd/deb-systemd-helper-enabled/{UNIT}.dsh-also"):
        assert not os.path.lexists(os.path.join(root, gone)), gone
    assert passwd_entry(root, "passwd", "kestrel") is None and passwd_entry(root, "group", "kestrel") is None
    assert os.listdir(os.path.join(root, "var/lib/kestrel-appliance")) == ["models"]
    assert sorted(os.listdir(os.path.join(models, "default"))) == sorted(os.listdir(tiny_qwen3_tied))
    assert in_root(root, "dpkg-query", "-W", PKG).returncode != 0  # not even config-files left


def test_bad_arguments_are_one_line_errors(tmp_path):
    deb = os.path.join(REPO, "build", "deb.sh")
    r = subprocess.run(["bash", deb, "--arch", "mips"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip() == "deb.sh: --arch must be arm64 or amd64"
    r = subprocess.run(["bash", deb, "--binary", "/bin/sh", "--arch", "arm64", "--libc", "2.30",
                        "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().startswith("deb.sh: /bin/sh is not an aarch64 executable")
