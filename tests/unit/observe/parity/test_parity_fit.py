"""The parity check shrinks a model that does not fit this machine (trainer/observe/parity/fit.py): the planner's
estimate of each side against the memory here."""
from __future__ import annotations

import pytest

from trainer.observe.parity import fit
from trainer.observe.parity.command import main
from trainer.observe.parity.sides import composed


def test_a_side_that_does_not_fit_is_named(monkeypatch):
    cfg = composed("A", ["strategy=ddp"], 2)
    need = fit.needed_bytes(cfg, 2)
    assert need > 2 * 3_000_000 * 4  # the tiny default's ~3M fp32 parameters, twice (two ranks on one host)
    monkeypatch.setattr(fit, "available_bytes", lambda: need / fit.HEADROOM * 2)
    assert fit.too_big([("A", cfg, 2)]) is None
    monkeypatch.setattr(fit, "available_bytes", lambda: need / fit.HEADROOM / 2)
    why = fit.too_big([("A", cfg, 2), ("B", cfg, 2)])
    assert why.startswith("side A needs about") and "usable here" in why


def test_no_shrink_refuses_a_model_that_does_not_fit(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fit, "available_bytes", lambda: 1.0)
    code = main(["strategy=single", "--against", "strategy=ddp", "--no-shrink", "--steps", "2",
                 "--out", str(tmp_path / "p")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: side A needs about") and "drop --no-shrink" in err
