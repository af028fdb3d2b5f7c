"""Numbers people read: sizes in the unit that fits (reshard::FormatBytes, one rule for the
CLI and Python), and progress lines on a terminal for verify and export (none when the output
is piped, none with --json, whose output is unchanged)."""

from __future__ import annotations

import json
import re

import pytest

import reshard

SIZE = r"[0-9]+(\.[0-9]+)? (B|KB|MB|GB|TB)"


def test_format_bytes():
    cases = {0: "0 B", 999: "999 B", 1000: "1.00 KB", 1536: "1.54 KB", 12_345_678: "12.3 MB",
             999_999: "1.00 MB", 7_600_000_000: "7.60 GB", 140 * 10**12: "140 TB"}
    for n, want in cases.items():
        assert reshard.format_bytes(n) == want, n
    assert reshard.format_rate(6.6e9) == "6.60 GB/s"
    assert reshard.format_rate(float("nan")) == "-"


@pytest.fixture
def ckpt(checkpoint):
    return checkpoint("qwen2", "bf16", False)


@pytest.fixture
def out(cli, ckpt, tmp_path):
    out = tmp_path / "out"
    cli("convert", ckpt, "-o", out, "--world-size", 2, rc=0)
    return out


def test_cli_sizes_fit(cli, ckpt, tmp_path):
    o = tmp_path / "o"
    j = json.loads(cli("convert", ckpt, "-o", o, "--world-size", 2, "--json", rc=0).out)
    assert j["bytes_read"] < 10**7  # a tiny model: what used to print as "0.00 GB"
    r = cli("convert", ckpt, "-o", tmp_path / "o2", "--world-size", 2, rc=0)
    m = re.search(rf": ({SIZE}) read in [0-9.]+ s \(({SIZE}/s|-)\)", r.out)
    assert m and m.group(1) == reshard.format_bytes(j["bytes_read"]), r
    v = json.loads(cli("verify", o, "--source", ckpt, "--json", rc=0).out)
    r = cli("verify", o, "--source", ckpt, rc=0)
    assert f"{reshard.format_bytes(v['bytes'])} checked, {reshard.format_bytes(v['source_bytes_compared'])} " \
           "compared with the source" in r.out, r
    e = json.loads(cli("export", o, "-o", tmp_path / "hf1", "--json", rc=0).out)
    r = cli("export", o, "-o", tmp_path / "hf2", rc=0)
    assert f"{reshard.format_bytes(e['total_size'])} in " in r.out, r
    r = cli("inspect", o, rc=0)
    for text in (r.out, cli("inspect", ckpt, rc=0).out):
        assert re.search(SIZE, text) and "0.00 GB" not in text and " kB" not in text, text


PROGRESS = re.compile(rf"\r\x1b\[K  (\S+: )?{SIZE} / {SIZE}  ({SIZE}/s|-)  ETA [0-9]+ s")


def test_progress_on_a_terminal_only(cli, out, ckpt, tmp_path):
    text = cli("verify", out, "--source", ckpt, tty=True, rc=0).out
    assert PROGRESS.search(text), repr(text)
    assert re.search(r"fsdp2-ws2: ", text), repr(text)  # verify names the layout it checks
    assert "OK: " in text
    text = cli("export", out, "-o", tmp_path / "hf-tty", tty=True, rc=0).out
    assert PROGRESS.search(text), repr(text)
    # The last progress line shows everything done: "X / X".
    last = [m.group(0) for m in PROGRESS.finditer(text)][-1]
    done, total = re.search(rf"({SIZE}) / ({SIZE})", last).group(1, 4)
    assert done == total, repr(last)
    # Piped: no progress at all, only the summary.
    for r in (cli("verify", out, "--source", ckpt, rc=0), cli("export", out, "-o", tmp_path / "hf-pipe", rc=0)):
        assert "ETA" not in r.text and "\r" not in r.text, r
    # --json on a terminal: the JSON alone, unchanged.
    text = cli("verify", out, "--json", tty=True, rc=0).out
    assert "ETA" not in text, repr(text)
    assert json.loads(text)["ok"] is True
    text = cli("export", out, "-o", tmp_path / "hf-json", "--json", tty=True, rc=0).out
    assert "ETA" not in text and json.loads(text)["tensors"] > 0, repr(text)


def test_load_report_reads_as_a_sentence():
    from reshard.engine import LoadReport

    r = LoadReport(file="/o/fsdp2-ws2/rank-00000-of-00002.reshard", layout="fsdp2-ws2", rank=0,
                   world_size=2, bytes=51_800, seconds=0.004, gbps=51_800 / 0.004 / 1e9, tensors=7,
                   staging_bytes=0, direct_io=False, threads=1, converted_tensors=0, buffers_restored=[])
    assert str(r) == ("rank 0/2: loaded 51.8 KB of fsdp2-ws2 from /o/fsdp2-ws2/rank-00000-of-00002.reshard "
                      "in 0.004 s (12.9 MB/s), 7 tensor(s)")
    assert "bytes=51800" in repr(r)
