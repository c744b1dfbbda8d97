"""The planner's "fused" index-selection path (the Pallas indexer kernel, PlanOptions.indexer_impl="pallas"):
launches sized to B_idx with the kernel's own tiling, the maximum context planned, the CLI shows it."""

from __future__ import annotations

import json

import pytest

from dsv41_jax.config import load_named
from dsv41_jax.plan import main
from dsv41_jax.planner import MiB, PlanOptions, plan_decode_window, plan_segment
from pallas_kernels.indexer.tiling import launch_rows, workspace_bytes

FULL = load_named("dsv41_flash")
PALLAS = PlanOptions(indexer_impl="pallas")


@pytest.mark.parametrize("start", [0, 300_000, 1_048_576 - 2048])
def test_fused_paths_fit_the_index_budget(start):
    plan = plan_segment(FULL, 4, 0, 2048, start, PlanOptions(indexer_impl="pallas", experts="fp4"))
    assert len(plan.index_paths) == len(FULL.index_source_layer_ids)
    for ip in plan.index_paths:
        r = FULL.ratio(ip.layer)
        keys = -(-FULL.max_position_embeddings // r)
        assert ip.kind == "fused" and ip.visible == (start + 2048) // r
        assert ip.rows_per_launch * ip.launches >= 2048 and ip.rows_per_launch % 16 == 0
        source = ip.layer == FULL.candidate_source_layer_id
        kw = dict(heads=32, head_dim=128, block_size=8, keep_blocks=2048 if source else 0,
                  masked=FULL.uses_candidates(ip.layer))
        ws = workspace_bytes(1, ip.rows_per_launch, keys, 512, **kw)
        assert ip.scratch_bytes == sum(ws.values())
        assert sum(ws.values()) - ws["keys"] <= PALLAS.index_budget    # rows per launch obey B_idx
    assert plan.workspace_bytes["L.index.scratch"] == max(ip.scratch_bytes for ip in plan.index_paths)


def test_launch_rows_halve_until_the_budget_holds():
    kw = dict(heads=32, head_dim=128)
    assert launch_rows(1, 2048, 2048, 512, budget=256 * MiB, **kw) == 2048          # position 0: one launch
    rows = launch_rows(1, 2048, 1 << 20, 512, budget=256 * MiB, **kw)
    assert rows in (128, 256) and launch_rows(1, 2048, 1 << 20, 512, budget=1, **kw) == 16


def test_decode_windows_use_the_kernel_with_key_splits():
    plan = plan_decode_window(FULL, 1, 0, 8, 300_000, PALLAS)
    assert {ip.kind for ip in plan.index_paths} == {"fused"}
    assert all(ip.splits > 1 and ip.launches == 1 for ip in plan.index_paths)


def test_plan_cli_shows_the_fused_path(capsys):
    assert main(["--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "300000",
                 "--experts", "fp4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {p["kind"] for p in out["index_paths"]} == {"fused"}
    assert main(["--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "300000",
                 "--experts", "fp4", "--json", "--indexer", "reference"]) == 0
    assert "fused" not in {p["kind"] for p in json.loads(capsys.readouterr().out)["index_paths"]}
