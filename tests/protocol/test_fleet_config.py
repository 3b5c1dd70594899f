"""`kestrel-appliance fleet-config`: board addresses checked, the configuration's parts for N boards, the shipped
template (image/nginx/kestrel-fleet.conf) equal to what the command prints for its boards, bad input a one-line
error with exit status 2, and the board-name rule (protocol/board.py). nginx itself reads the output in
tests/system/test_system_fleet.py (`nginx -t`, and a fleet under load)."""
from __future__ import annotations

import os
import re

import pytest

from appliance import cli
from appliance.fleet import FleetOptions, parse_board, render
from appliance.protocol.board import board_headers, board_name_problem, with_board

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(ROOT, "image", "nginx", "kestrel-fleet.conf")


@pytest.mark.parametrize("text,expected", [("192.168.1.21:8080", "192.168.1.21:8080"), ("board-a.lan:80", "board-a.lan:80"),
                                           (" kiosk:08080 ", "kiosk:8080"), ("[fe80::1]:8080", "[fe80::1]:8080")])
def test_board_addresses(text, expected):
    assert parse_board(text) == expected


@pytest.mark.parametrize("text,why", [("192.168.1.21", "not HOST:PORT"), ("host:0", "between 1 and 65535"),
                                      ("host:70000", "between 1 and 65535"), ("[zz::1]:80", "not an IPv6"),
                                      ("bad_host;:80", "not a host name"), ("-x:80", "not a host name"),
                                      ("fe80::1:80", "not HOST:PORT")])
def test_bad_board_addresses(text, why):
    with pytest.raises(ValueError, match=why):
        parse_board(text)


def test_the_config_for_two_boards():
    text = render(["10.0.0.1:8080", "10.0.0.2:8080"], FleetOptions(listen="127.0.0.1:9000", fail_timeout_s=7))
    affinity = re.search(r"upstream kestrel_affinity \{(.*?)\n\}", text, re.DOTALL).group(1)
    least = re.search(r"upstream kestrel_least_conn \{(.*?)\n\}", text, re.DOTALL).group(1)
    assert "hash $kestrel_conversation consistent;" in affinity and "least_conn;" in least
    assert re.findall(r"server (\S+) max_fails=1 fail_timeout=7s;", affinity) == ["10.0.0.1:8080", "10.0.0.2:8080"]
    assert re.findall(r"server (\S+) max_fails=0;", least) == ["10.0.0.1:8080", "10.0.0.2:8080"]
    assert text.count("proxy_next_upstream_tries 2;") == 2
    assert "proxy_next_upstream error timeout http_429 http_503 non_idempotent;" in text   # the least_conn pool
    assert "proxy_next_upstream error timeout http_503 non_idempotent;" in text          # the hash pool: 429 spills
    assert "error_page 429 = @kestrel_spill;" in text and "listen 127.0.0.1:9000;" in text
    for line in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                 "proxy_read_timeout 600s;", "keepalive 16;", "client_body_buffer_size 4m;"):
        assert line in text, line
    assert text.count("{") == text.count("}")


def test_the_template_is_what_the_command_prints(capsys):
    with open(TEMPLATE) as f:
        template = f.read()
    command = re.search(r"^# Made by: kestrel-appliance fleet-config (.*)$", template, re.MULTILINE).group(1)
    assert cli.main(["fleet-config", *command.split()]) == 0
    assert capsys.readouterr().out == template
    assert template.count("server 192.168.1.") == 6


@pytest.mark.parametrize("args,why", [([], "--board"), (["--board", "host"], "not HOST:PORT"),
                                      (["--board", "a:1", "--board", "a:1"], "named twice"),
                                      (["--board", "a:1", "--read-timeout", "0"], "at least 1"),
                                      (["--board", "a:1", "--listen", "80; evil"], "one word"),
                                      (["--board", "a:1", "--access-log", "/x;y"], "--access-log")])
def test_bad_input_is_one_line_and_status_2(capsys, args, why):
    with pytest.raises(SystemExit) as e:
        cli.main(["fleet-config", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert why in err[-1] and err[-1].startswith("kestrel-appliance fleet-config: error:")


def test_board_names():
    assert board_name_problem("rk3588-kiosk-2") is None and board_name_problem("a" * 64) is None
    assert board_name_problem("") == "is empty" and "longer" in board_name_problem("a" * 65)
    assert "visible ASCII" in board_name_problem("a b") and "visible ASCII" in board_name_problem("a\r\nX: y")
    assert board_headers("") == () and board_headers("b1") == ((b"X-Kestrel-Board", b"b1"),)
    with pytest.raises(ValueError):
        board_headers("a\nb")
    assert with_board([(b"A", b"1")], board_headers("b1")) == [(b"A", b"1"), (b"X-Kestrel-Board", b"b1")]
