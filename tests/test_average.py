"""The weights' moving average (train.ema_decay): what it computes, what checkpoints hold,
and that a resumed job continues the same trajectory."""

import json

import pytest
import torch

from genrec.config import ConfigError
from genrec.train.job import load_job
from genrec.train.loop import checkpoint as ckpt
from genrec.train.loop.average import AveragedWeights
from genrec.train.loop.launch import run_training
from tests.conftest import tiny_job_overrides


def test_the_average_follows_its_formula_and_is_what_a_checkpoint_model_holds(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    avg = AveragedWeights(ckpt.PlainState(net, opt), net, decay=0.5)
    expect = {n: p.detach().clone() for n, p in net.named_parameters()}
    for t in range(4):
        net(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        avg.update()
        d = min(0.5, (1 + t) / (10 + t))  # 0.1, 0.18..., 0.25, then the decay 0.5
        for n, p in net.named_parameters():
            expect[n] = d * expect[n] + (1 - d) * p.detach()
    trained = {n: p.detach().clone() for n, p in net.named_parameters()}
    for n in expect:
        torch.testing.assert_close(avg.avg[n], expect[n])
        assert not torch.allclose(expect[n], trained[n])
    with avg.applied():  # evaluation sees the average ...
        torch.testing.assert_close(net.weight, expect["weight"])
    torch.testing.assert_close(net.weight, trained["weight"])  # ... training continues from its weights
    path = ckpt.save_checkpoint(tmp_path, 4, avg.state(), {})
    # what eval / quantize / serving load: the average
    fresh = torch.nn.Linear(3, 2)
    ckpt.PlainState(fresh, None).restore(path, with_optimizer=False)
    torch.testing.assert_close(fresh.weight, expect["weight"])
    # a trainer resuming gets both back
    net2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
    avg2 = AveragedWeights(ckpt.PlainState(net2, opt2), net2, decay=0.5)
    ckpt.restore(avg2, path)
    torch.testing.assert_close(net2.weight, trained["weight"])
    torch.testing.assert_close(avg2.avg["weight"], expect["weight"])
    assert avg2.steps == 4


def losses(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}, [r for r in recs if r.get("split") == "valid"]


def test_an_averaged_run_resumes_exactly_and_validates_the_average(tiny_synth, tiny_config, tmp_path):
    base = tiny_job_overrides(tiny_synth, tmp_path) + ["--train.max_epochs=2", "--train.log_every_steps=1"]
    ema = ["--train.ema_decay=0.9"]
    straight_dir, straight = run_training(load_job(tiny_config, base + ema + ["--run.name=straight"]))
    part_dir, _ = run_training(load_job(tiny_config, base + ema + ["--run.name=parts", "--train.max_steps=5",
                                                                   "--train.checkpoint_every_steps=5"]))
    _, resumed = run_training(load_job(part_dir / "config.toml", ["--train.max_steps=0"]), part_dir)
    plain_dir, plain = run_training(load_job(tiny_config, base + ["--run.name=plain"]))
    (a, va), (b, vb), (c, vc) = losses(straight_dir), losses(part_dir), losses(plain_dir)
    assert len(a) == 20 and sorted(b) == sorted(a)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
        assert c[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step  # averaging leaves training alone
    at = {v["step"]: v["ndcg@10"] for v in vb}  # the stopped part also validated at its step 5
    assert [at[v["step"]] for v in va] == pytest.approx([v["ndcg@10"] for v in va], abs=1e-6)
    assert resumed["test"] == pytest.approx(straight["test"], abs=1e-6)
    # ... but what is validated and tested is another model than the trained weights
    assert straight["test"] != pytest.approx(plain["test"], abs=1e-6)
    assert [v["ndcg@10"] for v in va] != pytest.approx([v["ndcg@10"] for v in vc], abs=1e-6)


def test_a_decay_outside_zero_to_one_is_a_config_error(tiny_synth, tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="ema_decay"):
        load_job(tiny_config, tiny_job_overrides(tiny_synth, tmp_path) + ["--train.ema_decay=1.0"])
