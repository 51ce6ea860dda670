"""Tests for benchmarks/a2a_cost_model.py: hand-computed cases, limits, CLI, input errors.

Legend: S bytes per rank, W ranks, N nodes, L GPUs per node; times in seconds unless named _ms.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "a2a_cost_model.py"
_spec = importlib.util.spec_from_file_location("a2a_cost_model", _PATH)
cm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cm
_spec.loader.exec_module(cm)

US = 1e-6


def test_tiny_case_by_hand_default_links():
    # W=4, L=2, N=2, S=4e6 bytes: 1e6 bytes per peer.
    # Links: intra 3 us, 150e9 B/s; inter 10 us, 25e9 B/s; copies at 1000e9 B/s.
    S, W, L = 4e6, 4, 2
    intra = 1 * (3 * US + 1e6 / 150e9)          # L-1 = 1 local peer, S/W bytes
    inter = 2 * (10 * US + 1e6 / 25e9)          # W-L = 2 remote peers, S/W bytes each
    assert intra == pytest.approx(9.6667 * US, rel=1e-4)
    assert inter == pytest.approx(100 * US)
    assert cm.flat_seconds(S, W, L) == pytest.approx(100 * US)
    assert cm.flat_seconds(S, W, L, serial=True) == pytest.approx(109.6667 * US, rel=1e-4)

    phase1 = 1 * (3 * US + 2e6 / 150e9)         # L-1 = 1 message of S/L = 2e6 bytes
    copies = 2 * 4e6 / 1000e9                   # two stride copies of S bytes
    phase2 = 1 * (10 * US + 2e6 / 25e9)         # N-1 = 1 message of S/N = 2e6 bytes
    assert (phase1, copies, phase2) == pytest.approx((16.3333 * US, 8 * US, 90 * US), rel=1e-4)
    assert cm.hier_seconds(S, W, L) == pytest.approx(114.3333 * US, rel=1e-4)


def test_second_case_by_hand_custom_links():
    # W=8, L=4, N=2, S=8e6: 1e6 bytes per peer; every link parameter differs from the default.
    links = cm.Links(intra_latency_us=1, intra_gbps=100, inter_latency_us=5, inter_gbps=10,
                     mem_gbps=500)
    flat = max(3 * (1 * US + 1e6 / 100e9), 4 * (5 * US + 1e6 / 10e9))        # max(33, 420) us
    hier = 3 * (1 * US + 2e6 / 100e9) + 2 * 8e6 / 500e9 + 1 * (5 * US + 4e6 / 10e9)  # 63+32+405
    assert flat == pytest.approx(420 * US)
    assert hier == pytest.approx(500 * US)
    assert cm.flat_seconds(8e6, 8, 4, links) == pytest.approx(flat)
    assert cm.hier_seconds(8e6, 8, 4, links) == pytest.approx(hier)


@pytest.mark.parametrize("S", [1e3, 1e6, 64e6])
def test_single_node_2dh_equals_flat(S):
    # N = 1: phase 2 and both copies vanish; both are L-1 intra-node messages of S/L.
    expected = 7 * (3 * US + (S / 8) / 150e9)
    assert cm.flat_seconds(S, 8, 8) == pytest.approx(expected)
    assert cm.hier_seconds(S, 8, 8) == pytest.approx(expected)
    assert cm.flat_seconds(S, 8, 8, serial=True) == pytest.approx(expected)


def test_one_gpu_per_node_2dh_equals_flat():
    # L = 1: phase 1 and both copies vanish; both are W-1 inter-node messages of S/W.
    expected = 15 * (10 * US + (16e6 / 16) / 25e9)
    assert cm.flat_seconds(16e6, 16, 1) == pytest.approx(expected)
    assert cm.hier_seconds(16e6, 16, 1) == pytest.approx(expected)
    assert cm.flat_seconds(16e6, 1, 1) == 0.0
    assert cm.hier_seconds(16e6, 1, 1) == 0.0


def test_2dh_wins_at_scale_with_small_per_peer_messages():
    rows = cm.table(1, gpus_per_node=8, max_gpus=2048)
    assert [r["gpus"] for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    speedups = [r["speedup"] for r in rows[1:]]
    assert speedups == sorted(speedups)
    # W=2048, S=1e6: flat = 2040 * (10 us + 1e6/2048/25e9); 2dh = 7 * (3 us + 1.25e5/150e9)
    # + 2e6/1e12 + 255 * (10 us + 1e6/256/25e9).
    flat = 2040 * (10 * US + 1e6 / 2048 / 25e9)
    hier = 7 * (3 * US + 1.25e5 / 150e9) + 2e6 / 1e12 + 255 * (10 * US + 1e6 / 256 / 25e9)
    assert rows[-1]["flat_ms"] == pytest.approx(flat * 1e3)
    assert rows[-1]["2dh_ms"] == pytest.approx(hier * 1e3)
    assert rows[-1]["speedup"] > 7


def test_without_latency_2dh_only_adds_cost():
    # Zero alpha: the inter-node bytes are equal, S(W-L)/W = S(N-1)/N, so 2DH pays exactly its
    # extra intra-node bytes S(L-1)(1/L - 1/W) and its two copies.
    links = cm.Links(intra_latency_us=0, inter_latency_us=0)
    S, W, L = 64e6, 256, 8
    extra = S * (L - 1) * (1 / L - 1 / W) / 150e9 + 2 * S / 1000e9
    flat = cm.flat_seconds(S, W, L, links, serial=True)
    assert cm.hier_seconds(S, W, L, links) - flat == pytest.approx(extra)


def test_json_output_parses(capsys):
    cm.main(["--message-mb", "1", "64", "--max-gpus", "64", "--inter-gbps", "50", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["serial"] is False
    assert out["links"]["inter_gbps"] == 50.0
    assert [(r["message_mb"], r["gpus"], r["nodes"]) for r in out["rows"]] == [
        (mb, w, w // 8) for mb in (1.0, 64.0) for w in (8, 16, 32, 64)]
    links = cm.Links(inter_gbps=50)
    row = out["rows"][-1]
    assert row["flat_ms"] == pytest.approx(cm.flat_seconds(64e6, 64, 8, links) * 1e3)
    assert row["2dh_ms"] == pytest.approx(cm.hier_seconds(64e6, 64, 8, links) * 1e3)
    assert row["speedup"] == pytest.approx(row["flat_ms"] / row["2dh_ms"])


def test_text_table(capsys):
    cm.main(["--message-mb", "64", "--max-gpus", "16"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].split() == ["W", "nodes", "flat", "ms", "2dh", "ms", "flat/2dh"]
    # W=8: 7 * (3 us + 8e6/150e9) = 0.394 ms; W=16: flat 1.360 ms, 2dh 1.812 ms.
    assert lines[-2].split() == ["8", "1", "0.394", "0.394", "1.00x"]
    assert lines[-1].split() == ["16", "2", "1.360", "1.812", "0.75x"]


@pytest.mark.parametrize("call, name", [
    (lambda: cm.flat_seconds(1e6, 12, 8), "world_size"),
    (lambda: cm.hier_seconds(1e6, 12, 8), "world_size"),
    (lambda: cm.flat_seconds(0, 8, 8), "message_bytes"),
    (lambda: cm.hier_seconds(-1e6, 16, 8), "message_bytes"),
    (lambda: cm.hier_seconds(1e6, 0, 8), "world_size"),
    (lambda: cm.flat_seconds(1e6, 8, 0), "gpus_per_node"),
    (lambda: cm.flat_seconds(1e6, 8.0, 8), "world_size"),
    (lambda: cm.table(0), "message_mb"),
    (lambda: cm.table(1, gpus_per_node=8, max_gpus=4), "max_gpus"),
    (lambda: cm.Links(intra_gbps=0), "intra_gbps"),
    (lambda: cm.Links(inter_gbps=-25), "inter_gbps"),
    (lambda: cm.Links(mem_gbps=0), "mem_gbps"),
    (lambda: cm.Links(inter_latency_us=-1), "inter_latency_us"),
])
def test_invalid_inputs_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit) as exc:
        cm.main(["--message-mb", "0"])
    assert exc.value.code == 2
    assert "message_mb must be > 0" in capsys.readouterr().err
