"""Does Sluice's learner take the step TRL's GRPOTrainer takes, on the same batch?

benchmarks/vs_trl.py races the two systems to a reward, and its mapping table says they train
one objective (advantages, token mask, loss aggregation, clipping, optimiser). This checks that
claim with numbers instead of reading, so a difference in steps to the threshold is known to come
from the draws (prompts, samples, and for Sluice the version a batch was sampled on), not from
the update (docs/architecture.md, "Cores and threads", where the figures are):

1. TRL 1.16's `GRPOTrainer` takes one real step (`train()`, `max_steps=1`) with vs_trl's
   `GRPOConfig`, model, task and reward. A subclass keeps the batch that
   `_generate_and_score_completions` returned; a callback keeps the gradients the optimiser is
   handed (after clipping) and the gradient norm TRL logs.
2. The same rows become Sluice trajectories: the prompt without TRL's left padding, the
   completion up to and including its EOS (TRL's completion mask), the task's reward, and the
   initial model's own log-probs as the behaviour policy (on-policy, as TRL is). Sluice's
   `Trainer.train_step` takes one step on them under vs_trl's `sluice run` overrides.
3. Compared: the advantages, the gradient norm before clipping, the clipped gradients and the
   parameters after the step. Float32 sums in another order differ in the last bits; the first
   AdamW step moves a parameter by about lr x sign(gradient), so a parameter whose gradient is
   within rounding of 0 may move the other way: the parameters are reported, not asserted.

    .venv/bin/python benchmarks/trl_parity.py [--seeds 0 1 2] [--task copy] [--out DIR]
        [--sluice-override KEY=VALUE ...]

Prints a table a seed and writes DIR/trl_parity.json; exits 1 where a seed's advantages or
gradients differ beyond the tolerances below. TRL is an optional peer (`bash
scripts/setup_bench.sh`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import vs_trl  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ADV_TOL = 1e-5  # absolute, advantages are O(1)
GRAD_TOL = 1e-4  # relative L2 of the clipped gradients, and of the norm before clipping


def spec_for(seed: int, task: str, model_dir: Path, work: Path, extra: list[str]) -> dict[str, Any]:
    """vs_trl's run spec for one step of `task` at `seed`; `extra`: Sluice overrides on top of
    vs_trl's (a mapping to try, or one the check must catch)."""
    return {
        "sluice_extra": extra,
        "seed": seed,
        "task": task,
        "group": vs_trl.GROUP,
        "max_steps": 1,
        "model_dir": str(model_dir),
        "output_dir": str(work / "trl"),
    }


# -- TRL's step --------------------------------------------------------------------------------


def trl_step(spec: dict[str, Any]) -> dict[str, Any]:
    """One GRPOTrainer step: the batch it generated, its clipped gradients and logged norm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    record: dict[str, Any] = {"grads": {}, "logs": {}}

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            record["references"] = [row["reference"] for row in inputs]  # the rows' order
            record["batch"] = {k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)}
            return out

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):  # after clipping
            record["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

        def on_log(self, args, state, control, logs=None, **_):
            record["logs"].update(logs or {})

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    task = vs_trl.make_task(spec["task"], spec["seed"] * vs_trl.TASK_SEED)
    trainer = Recording(
        model=model,
        reward_funcs=vs_trl.make_reward(task, tokenizer.eos_token_id),
        args=vs_trl.grpo_config(spec),
        train_dataset=vs_trl.trl_dataset(task, tokenizer, rows=vs_trl.PROMPTS),
        processing_class=tokenizer,
        callbacks=[Grads()],
    )
    trainer.train()
    record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    record["task"], record["tokenizer"] = task, tokenizer
    return record


# -- the same rows as Sluice trajectories --------------------------------------------------------


def rows_of(batch: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """Each row's prompt (TRL's left padding dropped) and completion (its mask: up to EOS)."""
    out = []
    for p, pm, c, cm in zip(
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
    ):
        out.append((p[pm.bool()].tolist(), c[cm.bool()].tolist()))
    return out


@torch.no_grad()
def behaviour_logprobs(model_dir: str, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The initial model's log-prob of each completion token: the policy that sampled it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt, completion in rows:
        ids = torch.tensor([prompt + completion])
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        targets = ids[0, 1:]
        out.append(logp.gather(-1, targets[:, None])[len(prompt) - 1 :, 0].tolist())
    return out


def trajectories(record: dict[str, Any], model_dir: str) -> list:
    """TRL's batch as Sluice trajectories: group i // group_size, the task's reward and
    `finished` as the rollout scores them (rollout_svc/service.py's `sample_trajectory`)."""
    import numpy as np

    from sluice.rollout_svc.tasks.base import Prompt
    from sluice.trajectory import Trajectory

    rows, tok, task = rows_of(record["batch"]), record["tokenizer"], record["task"]
    group = vs_trl.GROUP
    for g in range(0, len(rows), group):  # TRL's sampler repeats a prompt `group` times in a row
        if len({tuple(p) for p, _ in rows[g : g + group]}) != 1:
            raise RuntimeError(f"TRL's rows {g}..{g + group - 1} are not one prompt's group")
    trajs = []
    for i, ((prompt, completion), logps) in enumerate(zip(rows, behaviour_logprobs(model_dir, rows))):
        finished = tok.eos_token_id in completion
        text = tok.decode(completion, skip_special_tokens=True)
        reference = record["references"][i]
        trajs.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // group}",
                version=0,
                group_size=group,
                reward=task.score(Prompt("", "", reference), text, finished).reward,
                info={"truncated": not finished},
                arrays={
                    "prompt_ids": np.asarray(prompt, dtype=np.int32),
                    "completion_ids": np.asarray(completion, dtype=np.int32),
                    "behaviour_logprobs": np.asarray(logps, dtype=np.float32),
                    "token_versions": np.zeros(len(completion), dtype=np.int32),
                },
            )
        )
    return trajs


# -- Sluice's step -----------------------------------------------------------------------------


def sluice_step(spec: dict[str, Any], trajs: list, work: Path) -> dict[str, Any]:
    """One `Trainer.train_step` under vs_trl's overrides: the advantages its prepare stages
    computed, the gradients its optimiser was handed (after clipping), the norm it logged."""
    from sluice.config import load_config
    from sluice.learner.dist import DistContext
    from sluice.learner.trainer import Trainer

    overrides = [*vs_trl.sluice_overrides(spec, work / "sluice"), *spec["sluice_extra"]]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    dist = DistContext()
    trainer = Trainer(cfg, dist, Path(spec["model_dir"]))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    record: dict[str, Any] = {}

    def keep_grads(optimizer, args, kwargs) -> None:
        record["grads"] = {
            names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]
        }

    with torch.no_grad():
        piece = trainer.objective.prepare(trainer.backend.module, trajs, dist)
    record["advantages"] = piece.fields["advantages"].detach().cpu()
    trainer.backend.optimizer.register_step_pre_hook(keep_grads)
    record["stats"] = trainer.train_step(trajs)
    record["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return record


# -- the comparison ----------------------------------------------------------------------------


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every tensor of the two (same names)."""
    if a.keys() != b.keys():
        raise RuntimeError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    norm = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (diff / max(norm, 1e-300)) ** 0.5


def compare(trl: dict[str, Any], sluice: dict[str, Any], trajs: list, lr: float) -> dict[str, Any]:
    adv_trl = trl["batch"]["advantages"].float()
    adv_gap = float((sluice["advantages"].float() - adv_trl).abs().max())
    norm_trl, norm_sluice = float(trl["logs"]["grad_norm"]), float(sluice["stats"]["grad_norm"])
    moved = torch.cat([(sluice["params"][k] - trl["params"][k]).abs().flatten() for k in trl["params"]])
    result = {
        "sequences": len(trajs),
        "completion_tokens": sum(len(t.arrays["completion_ids"]) for t in trajs),
        "reward_mean": sum(t.reward for t in trajs) / len(trajs),
        "groups_with_signal": int((adv_trl.view(-1, vs_trl.GROUP).abs().sum(-1) > 0).sum()),
        "advantage_max_abs_diff": adv_gap,
        "grad_norm_trl": norm_trl,
        "grad_norm_sluice": norm_sluice,
        "grad_norm_rel_diff": abs(norm_sluice - norm_trl) / max(norm_trl, 1e-30),
        "clipped_grad_rel_l2": relative(sluice["grads"], trl["grads"]),
        "params_max_abs_diff_over_lr": float(moved.max()) / lr,
        "params_differing_share": float((moved > lr * 1e-2).double().mean()),
    }
    result["ok"] = (
        adv_gap <= ADV_TOL
        and result["grad_norm_rel_diff"] <= GRAD_TOL
        and result["clipped_grad_rel_l2"] <= GRAD_TOL
    )
    return result


def check_seed(seed: int, task: str, model_dir: Path, work: Path, extra: list[str]) -> dict[str, Any]:
    spec = spec_for(seed, task, model_dir, work, extra)
    torch.manual_seed(seed)
    trl = trl_step(spec)
    trajs = trajectories(trl, spec["model_dir"])
    sluice = sluice_step(spec, trajs, work)
    return {"seed": seed, "task": task} | compare(trl, sluice, trajs, vs_trl.LR)


def report(results: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="One step on TRL's batch: Sluice's learner against TRL's GRPOTrainer")
    cols = (
        ("seed", "seed"),
        ("reward", "reward_mean"),
        ("groups w/ signal", "groups_with_signal"),
        ("max |adv diff|", "advantage_max_abs_diff"),
        ("grad norm TRL", "grad_norm_trl"),
        ("grad norm rel diff", "grad_norm_rel_diff"),
        ("clipped grad rel L2", "clipped_grad_rel_l2"),
        ("max |param diff| / lr", "params_max_abs_diff_over_lr"),
        ("share of params > lr/100 apart", "params_differing_share"),
        ("ok", "ok"),
    )
    for name, _ in cols:
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(*(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for _, k in cols))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--task", choices=("copy", "reverse"), default="copy")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sluice-override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if not vs_trl.trl_available():
        sys.exit(vs_trl.SETUP_HINT)
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    with tempfile.TemporaryDirectory(prefix="trl-parity-") as tmp:
        work = Path(tmp)
        vs_trl.build_model_dir(work / "model")
        results = [
            check_seed(s, args.task, work / "model", work / f"seed{s}", args.sluice_override)
            for s in args.seeds
        ]
    console = Console()
    report(results, console)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"sluice_overrides": args.sluice_override, "results": results}
        (args.out / "trl_parity.json").write_text(json.dumps(data, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
