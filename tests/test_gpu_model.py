"""The launch model's error on the measured H200 records (no GPU: pure Python over the JSON).

The model (polynorm/bench/model.py) must reproduce the 364 records of
bench/results/gpu-2026-12-04b-h200.json with a median absolute error <= 0.08 of a copy
(issue 42); a change to the model, its parameters or the dispatcher's launches that
loses that fails here.  The committed predictions (model-2026-12-06-h200.json) must be
what the model gives today.
"""

from __future__ import annotations

import json

import pytest

from polynorm.bench import model

COMMITTED = model.ROOT / "bench" / "results" / "model-2026-12-06-h200.json"


@pytest.fixture(scope="module")
def rows():
    return model.compare(model.load_records())


def test_every_record_is_modelled_with_the_dispatchers_launches(rows):
    assert len(rows) == 364
    # the model derives the launches itself: they are the ones the records measured
    assert all(r["launch_matches"] for r in rows)


def test_median_error_within_issue_42(rows):
    err = model.errors(rows)
    assert err["all"]["copy_kernel"]["median"] <= 0.08
    assert err["all"]["copy"]["median"] <= 0.08
    for op in model.OPS:  # no op is left to the others' average
        assert err[op]["copy_kernel"]["median"] <= 0.08, op


def test_committed_predictions_are_current(rows):
    doc = json.loads(COMMITTED.read_text())
    assert doc["fitted_numbers"] == model.PARAMS.count()
    assert len(doc["rows"]) == len(rows)
    for old, new in zip(doc["rows"], rows, strict=True):
        assert (old["op"], old["dtype"], old["tokens"], old["d"]) == (new["op"], new["dtype"], new["tokens"], new["d"])
        assert old["pred_copy_kernel"] == pytest.approx(new["pred_copy_kernel"], abs=1e-3)
        assert old["pred_copy"] == pytest.approx(new["pred_copy"], abs=1e-3)


def test_model_terms():
    # more resident bytes per row iteration: the fused add reaches more of the copy than fwd
    fwd = model.predict("fwd", "bfloat16", 32768, 4096)
    add = model.predict("add", "bfloat16", 32768, 4096)
    assert add["copy_kernel"] > fwd["copy_kernel"]
    # a small case sits on the replay loop's floor: one launch per op
    small = model.predict("fwd", "bfloat16", 1, 1024)
    assert small["kernel_seconds"] >= model.PARAMS.host_launch
    assert len(model.predict("bwd", "bfloat16", 1, 1024)["kernels"]) == 2
    with pytest.raises(ValueError, match="op"):
        model.predict("nope", "bfloat16", 8, 1024)


def test_committed_bwd_rows_prediction_is_current():
    """bench/results/model-prediction-bwd-2026-12-06-h200.json is what the model gives today
    for pn_bwd_rows and the launches before it."""
    doc = json.loads((model.ROOT / "bench" / "results" / "model-prediction-bwd-2026-12-06-h200.json").read_text())
    new = model.bwd_rows_prediction()
    assert len(doc["rows"]) == len(new["rows"]) > 0
    for old, cur in zip(doc["rows"], new["rows"], strict=True):
        assert (old["dtype"], old["tokens"], old["d"], old["kernel"]) == (cur["dtype"], cur["tokens"], cur["d"],
                                                                          cur["kernel"])
        assert old["pred_copy_kernel"] == pytest.approx(cur["pred_copy_kernel"], abs=1e-3)
        assert old["before_pred_copy_kernel"] == pytest.approx(cur["before_pred_copy_kernel"], abs=1e-3)
