"""``rd2h probe memfabric`` without processes: the pattern, the descriptors, flag
validation and the command line (help, bad flags)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from rd2h.cli.main import build_parser, main
from rd2h.cli.probe import parse_size
from rd2h.probe.endpoints import PAGE, descriptors, first_difference, pattern
from rd2h.probe.run import ProbeConfig, ProbeResult, summary_text


def test_pattern_depends_on_seed_and_on_every_offset() -> None:
    a = pattern(5 * PAGE + 123, seed=7)
    assert a.dtype == np.uint8 and a.size == 5 * PAGE + 123
    np.testing.assert_array_equal(a, pattern(a.size, seed=7))
    assert (a != pattern(a.size, seed=8)).mean() > 0.9
    # Shifted by any multiple of the background period (or of a page) it no longer matches.
    for shift in (1, 251, 251 * 4, PAGE):
        assert first_difference(a[shift:], a[:-shift]) is not None
    stamps = [int.from_bytes(a[p * PAGE : p * PAGE + 8].tobytes(), "little") for p in range(6)]
    assert stamps == [p ^ 7 for p in range(6)]
    assert pattern(5, 1).size == 5 and pattern(1, 0).size == 1


def test_descriptors_cover_the_buffer_once_in_shuffled_order() -> None:
    local, remote, lengths = descriptors(1000, 50_000, size=10_000, block=3000, seed=1)
    assert sorted((local - 1000).tolist()) == [0, 3000, 6000, 9000]
    np.testing.assert_array_equal(local - 1000, remote - 50_000)
    assert dict(zip((local - 1000).tolist(), lengths.tolist())) == {
        0: 3000, 3000: 3000, 6000: 3000, 9000: 1000
    }
    assert int(lengths.sum()) == 10_000
    _, _, many = descriptors(0, 0, size=1 << 20, block=4096, seed=3)
    order, _, _ = descriptors(0, 0, size=1 << 20, block=4096, seed=3)
    assert many.size == 256 and not np.all(np.diff(order) > 0)  # not in address order


def test_first_difference_names_the_offset() -> None:
    a = pattern(1000, 2)
    b = a.copy()
    b[[10, 500]] ^= 0xFF
    assert first_difference(a, a.copy()) is None
    assert first_difference(b, a) == (
        f"2 of 1000 bytes differ, the first at offset 10 (got {int(b[10])}, "
        f"expected {int(a[10])})"
    )


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("512K") == 512 << 10
    assert parse_size("64M") == parse_size("64MiB") == parse_size("64mb") == 64 << 20
    assert parse_size("1G") == 1 << 30
    for bad in ["", "M", "1.5M", "-1", "12T", "lots"]:
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_size(bad)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"transport": "pigeon"}, "--transport"),
        ({"prefill_device": -1}, "--prefill-device"),
        ({"decode_device": -2}, "--decode-device"),
        ({"host": "localhost"}, "--host must be a numeric IPv4"),
        ({"store_url": "127.0.0.1:9"}, "store URL"),
        ({"transfer_type": "SMOKE"}, "--transfer-type"),
        ({"size": 0}, "--bytes"),
        ({"size": 100, "block": 101}, "--block-bytes"),
        ({"size": 1 << 30, "block": 1}, "descriptors"),
        ({"iterations": 0}, "--iterations"),
        ({"timeout_s": 0.0}, "--timeout"),
    ],
)
def test_flags_are_validated_up_front(change: dict, match: str) -> None:
    ProbeConfig().validate()
    with pytest.raises(ValueError, match=match):
        ProbeConfig(**change).validate()


def test_cma_does_not_need_an_ipv4_host() -> None:
    ProbeConfig(transport="cma", host="localhost").validate()


def test_help_explains_the_probe(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["probe", "memfabric", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for needle in ["--prefill-device", "--decode-device", "--store-url", "--transfer-type",
                   "DEVICE_RDMA", "--transport", "cma", "10^9 bytes/s", "Exit status",
                   "one sentence"]:
        assert needle in out


def test_probe_without_target_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe"]) == 2
    assert "memfabric" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bytes", "0"], "--bytes must be in"),
        (["--host", "my-host"], "--host must be a numeric IPv4"),
        (["--iterations", "0"], "--iterations"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(["probe", "memfabric", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("rd2h probe memfabric: ") and needle in captured.err
    assert captured.err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--serve", "--peer", "10.0.0.2:15000"], "give one side's flags only"),
        (["--peer", "10.0.0.2:15000", "--remote", "4096"], "go together"),
        (["--peer", "10.0.0.2", "--remote", "4096", "--seed", "1"], "--peer must be HOST:PORT"),
        (["--protocol", "carrier-pigeon"], "invalid choice"),
    ],
)
def test_mooncake_probe_flags_are_checked(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    with pytest.raises(SystemExit) if needle == "invalid choice" else _no_raise():
        assert main(["probe", "mooncake", *argv]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err


def test_serving_and_reading_are_for_mooncake_only() -> None:
    with pytest.raises(ValueError, match="transport mooncake only"):
        ProbeConfig(transport="cma", serve=True).validate()
    ProbeConfig(transport="mooncake", serve=True).validate()
    ProbeConfig(transport="mooncake", peer="10.0.0.2:15000", remote=4096, seed=7).validate()


def test_mooncake_help_says_how_to_probe_two_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["probe", "mooncake", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for needle in ["--serve", "--peer", "--remote", "--seed", "Decode host", "Prefill host",
                   "600", "verified"]:
        assert needle in out


def _no_raise():
    import contextlib

    return contextlib.nullcontext()


def test_summary_reports_devices_and_bandwidth() -> None:
    res = ProbeResult(
        transport="memfabric", bytes=1 << 26, descriptors=64, iterations=5, best_gbps=21.5,
        median_gbps=20.25, seconds=[0.003] * 5, prefill_session="10.0.0.1:41000",
        decode_session="10.0.0.2:41001", prefill_device=0, decode_device=1,
        transfer_type="SDMA", store_url="tcp://10.0.0.1:7000",
    )
    text = summary_text(res)
    assert "devices 0 -> 1" in text and "MemFabric SDMA" in text
    assert "best 21.50 GB/s, median 20.25 GB/s over 5 timed reads" in text
