"""A job restarted from checkpoint k: new communicator, new QPs, DDP's first bucket
layout again, and training iteration k+1 first. Replayed from the checkpoint of
iteration k, ckptd numbers and steps the iterations as the trainer does."""
import random

import torch

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint, save_checkpoint
from ckptd.core.optim import lr_at, torch_optimizer
from ckptd.pipeline import ReplayOptions, replay
from ckptd.core.plan import load_plan
from ckptd.testing.synth import SynthOptions, Wire, make_plan, trainer_checkpoint
from ckptd.testing.synth.model import build_model, shard_batches
from ckptd.testing.synth.ring import reduce_iteration
from parsers.pcap import write_pcap


def test_replay_from_a_later_checkpoint_numbers_iterations_from_it(tmp_path):
    opts = SynthOptions(out=str(tmp_path), ranks=2, channels=1, mirrors=1, model="tiny",
                        iterations=8, lr_schedule="cosine")
    rng = random.Random(0)
    model = build_model("tiny", 0)
    plan = make_plan(opts, model, rng)
    plan.save(tmp_path / "plan.json")
    params = dict(model.named_parameters())
    optimizer = torch_optimizer(plan.optimizer, model.named_parameters())
    k = 4  # the job restarts after iteration 4, from its checkpoint
    frames = []
    wire = Wire(plan, opts, rng)  # the restarted job's fresh connections
    for t in range(8):
        wire_it = t - (k + 1)
        layout = plan.layout(max(wire_it, 0))
        local = []
        for r in range(2):
            model.zero_grad(set_to_none=True)
            model.loss(shard_batches(model, r, t, 0)).backward()
            local.append([torch.cat([params[n].grad.reshape(-1) for n in b.params]).div_(2).numpy()
                          for b in layout])
        sched = plan.schedule(max(wire_it, 0))
        final, payloads = reduce_iteration(sched, local)
        for b, buf in enumerate(final):
            flat = torch.from_numpy(buf)
            for name, s, e in plan.param_ranges(max(wire_it, 0), b):
                params[name].grad = flat[s:e].view(params[name].shape).clone()
        lr = lr_at(plan.optimizer, t)
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.step()
        m, o = trainer_checkpoint(model, optimizer, lr)
        save_checkpoint(tmp_path / checkpoint_name(t), t, m, o)
        if wire_it >= 0:  # only the restarted run's traffic is captured
            frames += [f for s, d, f in wire.iteration_frames(sched, payloads) if plan.mirrors[0].sees(s[0], d[0], s[1], d[1])]
    write_pcap(tmp_path / "m.pcap", frames)
    pipe = replay(load_plan(tmp_path / "plan.json"), [str(tmp_path / "m.pcap")],
                  load_checkpoint(tmp_path / checkpoint_name(k)),
                  ReplayOptions(out=str(tmp_path / "out"), reference=str(tmp_path)))
    assert [r.iteration for r in pipe.reports] == [5, 6, 7]
    assert all(r.status == "committed" and r.exact for r in pipe.reports)
    assert diff_checkpoints(load_checkpoint(tmp_path / "out" / checkpoint_name(7)),
                            load_checkpoint(tmp_path / checkpoint_name(7))) == []
