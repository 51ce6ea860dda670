"""`moe-plugin checkpoint routing`'s load per expert-parallel rank (issue 55 item 1; moe_plugin/routing_monitor/report.py
add_rank_load): rows per rank counted by hand from the load per expert at several ep sizes (whole experts per rank,
experts sliced over ranks), the summary line, and an ep size that cannot hold the experts as a one-line error."""
import pytest

from moe_plugin.routing_monitor import report as routing_report


def routing(load):
    return {"layers": {"blocks.0.ffn": {"experts": len(load), "top_k": 1, "load": list(load),
                                        "coselection": [[0] * len(load) for _ in load], "topics": {}}}}


@pytest.mark.parametrize("ep_size, rows", [(1, [20.0]), (2, [13.0, 7.0]), (4, [12.0, 1.0, 7.0, 0.0]),
                                           (8, [12.0, 0.0, 0.0, 1.0, 7.0, 0.0, 0.0, 0.0])])
def test_rows_per_rank_are_the_experts_rows_of_each_rank(ep_size, rows):
    report = routing([12, 0, 0, 1, 7, 0, 0, 0])       # experts without tokens, ranks without rows
    routing_report.add_rank_load(report, ep_size)
    layer = report["layers"]["blocks.0.ffn"]
    assert layer["rows_per_rank"] == rows and layer["ep_size"] == ep_size
    assert layer["max_rank_load"] == pytest.approx(max(rows) / (sum(rows) / len(rows)))
    busiest = rows.index(max(rows))
    assert (f"at ep_size {ep_size}: busiest rank {busiest} computes {layer['max_rank_load']:.2f}x the mean rank's "
            f"routed rows") in routing_report.summary(report)


def test_sliced_experts_share_their_rows():
    report = routing([9, 3])
    routing_report.add_rank_load(report, 4)      # each expert sliced over 2 ranks: each computes all its rows
    assert report["layers"]["blocks.0.ffn"]["rows_per_rank"] == [4.5, 4.5, 1.5, 1.5]
    assert report["layers"]["blocks.0.ffn"]["max_rank_load"] == pytest.approx(1.5)


def test_an_ep_size_that_cannot_hold_the_experts_is_refused():
    with pytest.raises(ValueError, match="--ep-size 3 cannot hold MoE layer blocks.0.ffn's 8 experts"):
        routing_report.add_rank_load(routing([1] * 8), 3)
