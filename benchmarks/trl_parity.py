"""Does Sluice's learner take the steps TRL's GRPOTrainer takes, on the same batches?

benchmarks/vs_trl.py races the two systems to a reward, and its mapping table says they train
one objective (advantages, token mask, loss aggregation, clipping, optimiser). This checks that
claim with numbers instead of reading, so a difference in steps to the threshold is known to come
from the draws (prompts, samples, and for Sluice the version a batch was sampled on), not from
the update (docs/architecture.md, "Cores and threads", where the figures are):

1. TRL 1.16's `GRPOTrainer` trains `--steps` steps (`train()`, `max_steps`) with vs_trl's
   `GRPOConfig`, model, task and reward. A subclass keeps each batch that
   `_generate_and_score_completions` returned; a callback keeps the gradients the optimiser is
   handed each step (after clipping) and the gradient norms TRL logs.
2. The same rows become Sluice trajectories: the prompt without TRL's left padding, the
   completion up to and including its EOS (TRL's completion mask), the task's reward, and the
   learner's current log-probs as the behaviour policy (on-policy, as TRL is). Sluice's
   `Trainer.train_step` trains on each batch in turn under vs_trl's `sluice run` overrides.
3. Compared, at the worst step: the advantages, the gradient norm before clipping and the
   clipped gradients; and the weights' change over all the steps. Several steps, because the
   first AdamW step moves a parameter by about lr x sign(gradient) whatever the betas: only
   later steps show the optimiser's state. Float32 sums in another order differ in the last
   bits, so a parameter whose gradient is within rounding of 0 may move the other way: the
   largest single parameter difference is reported, not asserted.

    .venv/bin/python benchmarks/trl_parity.py [--seeds 0 1 2] [--task copy] [--steps 10]
        [--from-step N] [--out DIR] [--sluice-override KEY=VALUE ...]

`--from-step N`: both start from TRL's policy after N steps of its own training (fresh
optimisers), where many groups score alike: the rows Sluice leaves out of its step as having no
gradient (`learner.skip_zero_advantage`) are then a large share of each batch. The untrained
policy's first steps have few such groups.

Prints a table (a row a seed) and writes DIR/trl_parity.json; exits 1 where a seed's
advantages, gradients or weights differ beyond the tolerances below. TRL is an optional peer
(`bash scripts/setup_bench.sh`).
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
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

ADV_TOL = 1e-5  # absolute, advantages are O(1)
GRAD_TOL = 1e-4  # relative L2 of the clipped gradients, and of the norm before clipping
UPDATE_TOL = 1e-4  # relative L2 of the weights' change over the steps


def spec_for(
    seed: int, task: str, steps: int, model_dir: Path, work: Path, extra: list[str]
) -> dict[str, Any]:
    """vs_trl's run spec for `steps` steps of `task` at `seed`; `extra`: Sluice overrides on top
    of vs_trl's (a mapping to try, or one the check must catch)."""
    return {
        "sluice_extra": extra,
        "seed": seed,
        "task": task,
        "group": vs_trl.GROUP,
        "max_steps": steps,
        "model_dir": str(model_dir),
        "output_dir": str(work / "trl"),
    }


# -- TRL's steps -------------------------------------------------------------------------------


def trl_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """`max_steps` GRPOTrainer steps: each batch it generated (and its rows' references), the
    gradients its optimiser was handed (after clipping), the norms it logged, the end weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    record: dict[str, Any] = {"batches": [], "references": [], "grads": [], "grad_norms": []}

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            record["references"].append([row["reference"] for row in inputs])  # the rows' order
            record["batches"].append({k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)})
            return out

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):  # after clipping
            record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "grad_norm" in logs:
                record["grad_norms"].append(float(logs["grad_norm"]))

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    task = vs_trl.make_task(spec["task"], spec["seed"] * vs_trl.TASK_SEED)
    trainer = Recording(
        model=model,
        reward_funcs=vs_trl.make_reward(task, tokenizer.eos_token_id),
        args=vs_trl.grpo_config(spec),
        train_dataset=vs_trl.trl_dataset(task, tokenizer, rows=vs_trl.PROMPTS * spec["max_steps"]),
        processing_class=tokenizer,
        callbacks=[Grads()],
    )
    trainer.train()
    if spec.get("save_to"):  # a policy trained part-way, to compare steps from
        model.save_pretrained(spec["save_to"])
        tokenizer.save_pretrained(spec["save_to"])
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
def behaviour_logprobs(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """`model`'s log-prob of each completion token: the policy that sampled it (on-policy)."""
    out = []
    for prompt, completion in rows:
        ids = torch.tensor([prompt + completion])
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        out.append(logp.gather(-1, ids[0, 1:, None])[len(prompt) - 1 :, 0].tolist())
    return out


def trajectories(record: dict[str, Any], step: int, model: torch.nn.Module) -> list:
    """TRL's batch of `step` as Sluice trajectories, built as a rollout service builds its own
    (rollout_svc/: an engine's `Completion`, scored by the task into a `Sample`, then
    `sample_trajectory`): group i // group_size, the task's reward, `finished` = EOS sampled."""
    import numpy as np

    from sluice.rollout_svc.engines.base import Completion
    from sluice.rollout_svc.episodes import to_sample
    from sluice.rollout_svc.service import sample_trajectory
    from sluice.rollout_svc.tasks.base import Prompt

    rows, tok, task = rows_of(record["batches"][step]), record["tokenizer"], record["task"]
    group = vs_trl.GROUP
    for g in range(0, len(rows), group):  # TRL's sampler repeats a prompt `group` times in a row
        if len({tuple(p) for p, _ in rows[g : g + group]}) != 1:
            raise RuntimeError(f"TRL's rows {g}..{g + group - 1} are not one prompt's group")
    trajs = []
    for i, ((prompt, completion), logps) in enumerate(zip(rows, behaviour_logprobs(model, rows))):
        ids = np.asarray(completion, dtype=np.int32)
        versions = np.full(len(ids), step, dtype=np.int32)
        done = Completion(ids, np.asarray(logps, dtype=np.float32), versions, tok.eos_token_id in completion)
        text = tok.decode(completion, skip_special_tokens=True)
        score = task.score(Prompt("", "", record["references"][step][i]), text, done.finished)
        sample = to_sample(done, score, truncated_reward=None)
        trajs.append(
            sample_trajectory(f"s{step}t{i}", f"s{step}g{i // group}", group, "default", prompt, sample, step)
        )
    return trajs


# -- Sluice's steps ----------------------------------------------------------------------------


def sluice_steps(spec: dict[str, Any], trl: dict[str, Any], work: Path) -> dict[str, Any]:
    """`Trainer.train_step` on each of TRL's batches in turn, under vs_trl's overrides: the
    advantages its prepare stages computed, the gradients its optimiser was handed (after
    clipping), the norms it logged, the end weights."""
    from sluice.config import load_config
    from sluice.learner.dist import DistContext
    from sluice.learner.trainer import Trainer

    overrides = [*vs_trl.sluice_overrides(spec, work / "sluice"), *spec["sluice_extra"]]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    dist = DistContext()
    trainer = Trainer(cfg, dist, Path(spec["model_dir"]))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    record: dict[str, Any] = {"advantages": [], "grads": [], "grad_norms": [], "reward_means": []}
    record["initial"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    def keep_grads(optimizer, args, kwargs) -> None:
        params = (p for g in optimizer.param_groups for p in g["params"])
        record["grads"].append({names[id(p)]: p.grad.detach().clone() for p in params})

    trainer.backend.optimizer.register_step_pre_hook(keep_grads)
    for step in range(len(trl["batches"])):
        trajs = trajectories(trl, step, trainer.model)
        with torch.no_grad():
            piece = trainer.objective.prepare(trainer.backend.module, trajs, dist)
        record["advantages"].append(piece.fields["advantages"].detach().cpu())
        record["reward_means"].append(sum(t.reward for t in trajs) / len(trajs))
        record["grad_norms"].append(trainer.train_step(trajs)["grad_norm"])
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


def compare(trl: dict[str, Any], sluice: dict[str, Any], lr: float) -> dict[str, Any]:
    """The two systems' steps side by side: the worst step of each figure, and the weights."""
    steps = range(len(trl["batches"]))
    adv_trl = [trl["batches"][k]["advantages"].float() for k in steps]
    norms = [(float(trl["grad_norms"][k]), float(sluice["grad_norms"][k])) for k in steps]
    moved = torch.cat([(sluice["params"][k] - trl["params"][k]).abs().flatten() for k in trl["params"]])
    update = {k: trl["params"][k] - sluice["initial"][k] for k in trl["params"]}
    ours = {k: sluice["params"][k] - sluice["initial"][k] for k in trl["params"]}
    result = {
        "steps": len(steps),
        "sequences_per_step": len(adv_trl[0]),
        "reward_mean": sum(sluice["reward_means"]) / len(steps),
        "groups_with_signal": sum(int((a.view(-1, vs_trl.GROUP).abs().sum(-1) > 0).sum()) for a in adv_trl),
        "advantage_max_abs_diff": max(
            float((sluice["advantages"][k].float() - adv_trl[k]).abs().max()) for k in steps
        ),
        "grad_norms_trl": [t for t, _ in norms],
        "grad_norm_rel_diff": max(abs(s - t) / max(t, 1e-30) for t, s in norms),
        "clipped_grad_rel_l2": max(relative(sluice["grads"][k], trl["grads"][k]) for k in steps),
        "update_rel_l2": relative(ours, update),
        "params_max_abs_diff_over_lr": float(moved.max()) / lr,
        "params_differing_share": float((moved > lr * 1e-2).double().mean()),
    }
    result["ok"] = (
        result["advantage_max_abs_diff"] <= ADV_TOL
        and result["grad_norm_rel_diff"] <= GRAD_TOL
        and result["clipped_grad_rel_l2"] <= GRAD_TOL
        and result["update_rel_l2"] <= UPDATE_TOL
    )
    return result


def check_seed(
    seed: int, task: str, steps: int, model_dir: Path, work: Path, extra: list[str], from_step: int = 0
) -> dict[str, Any]:
    if from_step:  # TRL trains the policy part-way; both systems' compared steps start there
        warm = spec_for(seed, task, from_step, model_dir, work / "warm", [])
        warm["save_to"] = model_dir = work / "warm" / "model"
        torch.manual_seed(seed)
        trl_steps(warm)
    spec = spec_for(seed, task, steps, model_dir, work, extra)
    torch.manual_seed(seed)
    trl = trl_steps(spec)
    sluice = sluice_steps(spec, trl, work)
    return {"seed": seed, "task": task} | compare(trl, sluice, vs_trl.LR)


def report(results: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="Steps on TRL's batches: Sluice's learner against TRL's GRPOTrainer (worst step)")
    cols = (
        ("seed", "seed"),
        ("steps", "steps"),
        ("reward", "reward_mean"),
        ("groups w/ signal", "groups_with_signal"),
        ("max |adv diff|", "advantage_max_abs_diff"),
        ("grad norm rel diff", "grad_norm_rel_diff"),
        ("clipped grad rel L2", "clipped_grad_rel_l2"),
        ("update rel L2", "update_rel_l2"),
        ("max |param diff| / lr", "params_max_abs_diff_over_lr"),
        ("params > lr/100 apart", "params_differing_share"),
        ("ok", "ok"),
    )
    for name, _ in cols:
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(*(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for _, k in cols))
    console.print(table)


def run_seeds(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    """`check_seed` for each seed on one model directory, with a progress line."""
    with tempfile.TemporaryDirectory(prefix="trl-parity-") as tmp, Progress(console=console) as progress:
        work = Path(tmp)
        vs_trl.build_model_dir(work / "model")
        after = f" after {args.from_step} of TRL's" if args.from_step else ""
        bar = progress.add_task(f"{args.task}: {args.steps} steps a seed{after}", total=len(args.seeds))
        results = []
        for seed in args.seeds:
            extra = args.sluice_override
            results.append(
                check_seed(
                    seed, args.task, args.steps, work / "model", work / f"seed{seed}", extra, args.from_step
                )
            )
            progress.advance(bar)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--task", choices=("copy", "reverse"), default="copy")
    parser.add_argument("--steps", type=int, default=10, help="steps of each system, one batch each")
    parser.add_argument(
        "--from-step", type=int, default=0, help="start both from TRL's policy after this many of its steps"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sluice-override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: at least 1, not {args.steps}")
    if args.from_step < 0:
        parser.error(f"--from-step: 0 or more, not {args.from_step}")
    if not vs_trl.trl_available():
        sys.exit(vs_trl.SETUP_HINT)
    console = Console(width=160)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    try:
        results = run_seeds(args, console)
    finally:
        torch.set_num_threads(threads)
    report(results, console)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tolerances = {"advantage": ADV_TOL, "gradient": GRAD_TOL, "update": UPDATE_TOL}
        data = {
            "sluice_overrides": args.sluice_override,
            "from_step": args.from_step,
            "tolerances": tolerances,
            "results": results,
        }
        (args.out / "trl_parity.json").write_text(json.dumps(data, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
