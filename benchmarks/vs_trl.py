"""TRL's GRPOTrainer and Sluice side by side: the same model directory, task, batch, sampling,
optimiser and loss, several seeds, time and steps to reward thresholds.

Workload: a random-init Llama of 344,448 parameters (hidden 128, MLP 272, 2 layers, 4 heads x
32, untied embeddings) over the `digits` vocabulary (a word-level tokenizer whose words are
single characters: character level in effect), built ONCE per benchmark run with Sluice's own
builder (`sluice.modeling.tiny.build_tiny_model`) and saved as a local Hugging Face directory
that both systems load. Nothing is downloaded. Tasks: `copy` and `reverse` of 3 digits
(`rollout_svc/tasks/digits.py`, partial-credit reward in [0, 1]). Each step: 8 prompts x 8
completions, at most 12 new tokens, temperature 1.0, one AdamW update, lr 3e-4.

Before the systems, the *bound*: plain torch on the same directory, (a) one training step
(forward, backward, clip, AdamW on 64 padded sequences of prompt + 12 completion tokens) and
(b) sampling 64 x 12 tokens with a KV cache, each the median of repeats after warm-up, with 1
and 2 torch threads. Bound per step = max(train@1, generate@1): one core per phase, perfectly
overlapped, which is the most two cores allow an asynchronous system. The VM's speed drifts by
+-15% over minutes, so each Sluice run is set against the bound (1 thread) measured again just
before and just after it (their mean; both are in the JSON). The bound's process (this one)
keeps the memory it frees, as every Sluice role does (`sluice.launch.heap.retain_freed_memory`):
with glibc's defaults the same plain-torch step faults its activations' pages in again each
step and took 4-6% longer, so this is the tighter bound. TRL runs as its users run it.

Stop rule: the 5-step trailing mean of the per-step mean reward reaches 0.9 (the first steps at
which it reached 0.5 and 0.7 are recorded too), or the run's clock passes `--budget` seconds
(default 180), the same for both systems: what is compared is time to the threshold, so each
gets the same time to reach it. A cap in steps gave the system with the faster step less time:
at 1,000 steps Sluice had stopped at ~65 s of clock while TRL still had ~125 s, and a Sluice run
that would have reached 0.9 at step 1,100 (~72 s, sooner than TRL's 105 s on seed 0) counted as
never reaching it. So by default only the budget ends a run: TRL's `max_steps` stays at 5,000
(TRL_STEPS; it also sizes TRL's prompt dataset, which is part of TRL's draw, so it stays as the
earlier passes ran it; 180 s of TRL's 0.066 s steps is ~2,700), and Sluice's learner gets a cap
the budget cannot reach (SLUICE_STEPS; at 5,000 two plateau runs stopped at 168 and 175 s).
`--max-steps N` caps both at N, as an on-policy comparison in steps wants. Points past the
budget are cut from both curves.
- TRL runs in its own process (`--trl-worker`); a TrainerCallback records (step, reward, wall
  time since on_train_begin) at each log (every step) and sets `should_training_stop`. Per
  step: time in `_generate_and_score_completions` (generation + reward + advantages),
  `training_step` minus that (forward + backward), and the rest of the step (clip, AdamW,
  scheduler, zero_grad). Clock: on_train_begin.
- Sluice runs as `python -m sluice.cli run CONFIG ... --no-progress` in its own process group;
  `<run dir>/metrics/learner.jsonl` is tailed and the group gets SIGTERM once the rule is met
  (SIGKILL after a grace period; leftover roles are killed by the pids in `endpoints/`). Its
  reward is the learner's `reward_mean` (the batch trained at that step). Clock: the first
  generation, i.e. min over rollout records of time - put_s - score_s - generate_s (the record
  is written after the PUT). A vLLM engine's first generate includes its warm-up, so that is
  inside the clock; `first_generate_s` reports it.
Start-up (process start to clock start) is reported apart for both. Tokens/s: completion tokens
trained per second of clock time, up to the 0.9 step (or the last step).

CPU per step (cpu_use.py): the CPU seconds of each process (Sluice: its learner, split into the
training thread and the rest, its rollout services, shards and launcher; TRL: its process, split
the same way) from step 20 to the run's end, per step, and `cores busy`, their sum over the
cores' capacity in that window. It tells a system that waits from one that fills the machine,
and what the step costs in CPU beside what it costs in time.

Repeats (`--repeats N`): Sluice's sampling depends on which weights version each rollout holds
at each moment, i.e. on timing, so one run of a seed is one draw; whether a run escapes the
copy task's 0.75 plateau (architecture.md, "Steps to a reward are a distribution over seeds")
changes from draw to draw. Each seed then gets N Sluice runs against its one TRL run (TRL's
steps to 0.9 repeated exactly per seed across sessions), a row each; the summary says in how
many of the N passes over the seeds Sluice was faster on every seed, and whether its share of
runs at 0.9 was at least TRL's at every wall time (the plot's bottom panel).

Group (`--group N`, default 8): completions per prompt in both systems, a step being 8 prompts
x N (rollout.group_size / learner.batch_size; num_generations / per_device_train_batch_size),
and the bound measured on that batch. A larger group makes the copy task's plateau rarer
(architecture.md, the same section), so the comparison depends less on which seed is lucky.

DAPO's dynamic sampling (`--sluice-override 'workflow.rollout=[{stage: drop_zero_variance}]'`)
drops the plateau's zero-advantage groups at Sluice's rollouts; TRL 1.16 has no such option, so
that run is not a matched comparison (architecture.md, "DAPO's dynamic sampling ends the plateau
lottery"). The JSON's `workload.sluice_overrides` records it; the stop rule then reads a batch
that lacks the uniform groups, which crossed 0.9 after the generated samples did in every run.

Mapping of every setting (Sluice: `sluice run` overrides on top of `--sluice-config`,
default configs/quickstart.yaml; TRL 1.16.0: GRPOConfig / trainer arguments):

setting       Sluice                                     TRL
------------  -----------------------------------------  ---------------------------------------------------
model         model.path=<dir>                           AutoModelForCausalLM / AutoTokenizer
                                                         .from_pretrained(<dir>)
precision     model.dtype=float32                        bf16=False (GRPOConfig's default is True),
                                                         use_cpu=True
prompts       the task's sample(), seed run.seed * 7919  the same task class's sample(), seed seed * 7919,
              + service index; ids [<bos>] + words       in an in-memory datasets.Dataset; text
                                                         "<bos> " + prompt: the same ids (checked at start)
batch         rollout.prompts_per_batch=8                per_device_train_batch_size=64, num_generations=8,
(--group 8)   rollout.group_size=8                       gradient_accumulation_steps=1 (generation batch =
              learner.batch_size=64                      train batch = 64)
length        rollout.max_new_tokens=12                  max_completion_length=12
sampling      rollout.temperature=1.0, full vocabulary,  temperature=1.0, top_p=1.0, top_k=0, min_p=None,
              multinomial                                repetition_penalty=1.0 (HF generate, do_sample)
reward        task.score(prompt, decode(ids,             the same score() on batch_decode(ids,
              skip_special_tokens=True), finished),      skip_special_tokens=True) (ids cut after the first
              finished = EOS sampled                     EOS), finished = EOS in ids
advantages    (r - mean_g) / (std_g + 1e-4), unbiased    scale_rewards="group": the same formula, unbiased
              std (learner.llm.normalize_std=true,       std, 1e-4 (hard-coded)
              learner.llm.adv_eps = its default 1e-4)
loss          learner.loss.type=grpo                     loss_type="dapo": -sum_t min(r A, clip(r) A) /
              learner.llm.aggregation=token:             tokens in the generation batch; r = pi / pi_old
              -sum_t min(pi/mu, is_cap) A log pi /       = 1 at num_iterations=1, so the gradient is
              tokens in the batch                        -sum_t A grad log pi / tokens
KL, entropy   learner.llm.kl_coef=0.0; the LLM objective beta=0.0 (no reference model), entropy_coef=0.0
              has no entropy term
updates       learner.epochs=1 minibatches=1             num_iterations=1, steps_per_generation=1
              micro_batches=1                            (one optimizer update per generation batch)
optimiser     torch AdamW, fused kernel (CPU, CUDA),     optim="adamw_torch_fused" (the same kernel: the
              learner.lr=3e-4, betas, adam_eps,          Trainer's default on torch>=2.8), learning_rate,
              weight_decay = LearnerConfig defaults      adam_beta1/2, adam_epsilon, weight_decay = the
              (passed explicitly)                        same values
grad clip     learner.grad_clip (default 1.0)            max_grad_norm = the same value
schedule      learner.lr_schedule=constant               lr_scheduler_type="constant", warmup_steps=0
              learner.warmup_steps=0                     (the Trainer's default decays linearly)
seed          run.seed=S rollout.seed=S                  seed=S
threads,      the config's defaults (try variants with   torch.set_num_threads(2); HF generate in the
engine, ...   --sluice-override)                         trainer's one process
logging       every step (learner.log_every default 1)   logging_steps=1, report_to=[], save_strategy="no"

Why "dapo": TRL 1.16's `_compute_loss` divides the masked token sum by `num_items_in_batch`,
the token count of the whole generation batch, which is what Sluice's token aggregation does
(its `Denominator` carries the whole batch's counts). "bnpo" divides by the local batch's
tokens: the same number with one process and no accumulation, as here; "grpo" is per-sequence.

What a step computes differs, not what it updates: Sluice leaves groups whose rewards all agree
(advantages exactly 0) out of its forward and backward (`learner.skip_zero_advantage`, default
on), where TRL computes them (its `frac_reward_zero_std`); benchmarks/trl_parity.py checks that
the updates are the same.

    .venv/bin/python benchmarks/vs_trl.py [--seeds 0 1 2] [--tasks copy reverse] [--budget 180]
        [--out DIR] [--skip-trl] [--repeats N] [--group N] [--quick] [--sluice-config PATH]
        [--sluice-override KEY=VALUE ...]

Writes DIR/vs_trl.json and DIR/vs_trl.png (reward vs wall time and vs steps, every run; the
share of each system's runs at 0.9 by wall time) and prints the tables. TRL is an optional
peer: `bash scripts/setup_bench.sh` installs it. `benchmarks/vs_trl_pool.py` pools several
results (passes from different sessions) into one comparison over all their seeds.
`--quick` is a smoke run (one seed, one task, 6 steps, a short bound, `rollout.engine=hf` so no
vLLM start-up): 35-60 s without TRL, 60-90 s with it, on this 2-core machine while others load it.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import sluice_run_cmd  # noqa: E402
from cpu_use import CpuSampler  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402
from seed_pairs import by_threshold, pairs_table, per_step  # noqa: E402

from sluice.config.learner import LearnerConfig  # noqa: E402
from sluice.launch.heap import retain_freed_memory  # noqa: E402
from sluice.launch.local import Tail  # noqa: E402
from sluice.metrics import read_jsonl  # noqa: E402

MODEL_INIT = {
    "arch": "llama",
    "vocab": "digits",
    "hidden_size": 128,
    "intermediate_size": 272,
    "num_layers": 2,
    "num_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "seed": 0,
}
TASK_LENGTH = 3
PROMPTS, GROUP = 8, 8  # GROUP: the default of --group; a step's batch is PROMPTS x group
MAX_NEW_TOKENS = 12
TEMPERATURE = 1.0
LR = 3e-4
THRESHOLDS = (0.5, 0.7, 0.9)
STOP_AT = 0.9
WINDOW = 5
TRL_THREADS = 2
BUDGET_S = 180.0  # clock seconds a run gets, the same for both systems (module docstring)
TRL_STEPS = 5000  # TRL's max_steps without --max-steps; it sizes TRL's prompt dataset too
SLUICE_STEPS = 100_000  # Sluice's learner.total_steps without --max-steps: the budget ends it first
CPU_WARMUP_STEPS = 20  # CPU per step is read from this step to the run's end (cpu_use.py)
TASK_SEED = 7919  # a rollout service's task seed is run.seed * 7919 + its index
LEARNER = LearnerConfig()  # Sluice's optimiser defaults, passed explicitly to both systems
ADV_EPS = LearnerConfig().llm.adv_eps  # TRL's group advantages hard-code 1e-4
SETUP_HINT = (
    "trl is not installed: run `bash scripts/setup_bench.sh` (trl==1.16.0 into .venv, torch untouched)"
)


# -- the workload ------------------------------------------------------------------------------


def build_model_dir(path: Path) -> int:
    """Save the workload's model and tokenizer under `path`; returns the parameter count."""
    from sluice.config.model import TinyModelInit
    from sluice.modeling.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(TinyModelInit(**MODEL_INIT))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def step_batch(group: int) -> int:
    """Sequences in one step of either system: PROMPTS prompts x `group` completions each."""
    return PROMPTS * group


def make_task(name: str, seed: int):
    from sluice.rollout_svc.tasks.digits import CopyTask, DigitsConfig, ReverseTask

    cls = {"copy": CopyTask, "reverse": ReverseTask}[name]
    return cls(DigitsConfig(length=TASK_LENGTH), seed)


def trailing_means(rewards: list[float], window: int = WINDOW) -> list[float | None]:
    """Mean of the last `window` values at each step; None before `window` steps exist."""
    return [
        None if i + 1 < window else sum(rewards[i + 1 - window : i + 1]) / window for i in range(len(rewards))
    ]


def crossings(curve: list[dict]) -> dict[str, dict | None]:
    """First (step, time) at which the trailing mean reaches each threshold."""
    means = trailing_means([c["reward"] for c in curve])
    out: dict[str, dict | None] = {}
    for thr in THRESHOLDS:
        i = next((i for i, m in enumerate(means) if m is not None and m >= thr), None)
        out[str(thr)] = None if i is None else {"step": curve[i]["step"], "time_s": curve[i]["time_s"]}
    return out


def reached(rewards: list[float]) -> bool:
    means = trailing_means(rewards)
    return bool(means) and means[-1] is not None and means[-1] >= STOP_AT


def summarize_curve(curve: list[dict]) -> dict:
    """What both systems report from their (step, time_s, reward, tokens) curve."""
    if not curve:
        return {"reached": False, "crossings": crossings([]), "steps": 0}
    cross = crossings(curve)
    end = cross[str(STOP_AT)]
    upto = [c for c in curve if end is None or c["step"] <= end["step"]]
    tokens = sum(c["tokens"] for c in upto)
    time_s = upto[-1]["time_s"]
    return {
        "reached": end is not None,
        "crossings": cross,
        "steps": upto[-1]["step"],
        "time_s": time_s,
        "s_per_step": time_s / max(upto[-1]["step"], 1),
        "tokens_per_s": tokens / time_s if time_s > 0 else None,
        "final_trailing_reward": trailing_means([c["reward"] for c in curve])[-1],
    }


def median_of(records: list[dict], keys: tuple[str, ...]) -> dict[str, float | None]:
    return {
        k: (statistics.median(vals) if (vals := [r[k] for r in records if k in r]) else None) for k in keys
    }


# -- processes ---------------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group `proc` leads, wait `grace_s`, then SIGKILL it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def role_pids(run_dir: Path) -> dict[str, int]:
    """Role name -> pid, from the endpoint record each role writes once it is up."""
    pids = {}
    for path in (run_dir / "endpoints").glob("*.json"):
        try:
            pid = json.loads(path.read_text()).get("pid")
        except (OSError, ValueError):  # being written
            continue
        if pid:
            pids[path.stem] = int(pid)
    return pids


def kill_leftover_roles(run_dir: Path) -> None:
    """Roles run in their own sessions; one that outlived its launcher (it should not: it gets
    SIGTERM when the launcher dies) would load the next measurement, so it is killed."""
    for pid in role_pids(run_dir).values():
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def watch(proc: subprocess.Popen, tail: Tail, watcher: Watcher, timeout_s: float) -> str:
    """Poll `tail` until the watcher sees the threshold or its clock budget spent, the process
    exits, or the timeout (from launch: a safety, start-up included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if watcher(tail.poll()):
            return "threshold"
        if watcher.over_budget():
            return f"budget ({watcher.budget_s:g} s)"
        if proc.poll() is not None:
            return "threshold" if watcher(tail.poll()) else f"exited ({proc.returncode})"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.5)


class Watcher:
    """Collects the per-step rewards of a run as they appear, drives its progress line and
    tells when the run's clock (`clock(first step record, latest)`, seconds) passed its budget."""

    def __init__(
        self,
        progress: Progress,
        label: str,
        reward_key: str,
        step_key: str,
        clock: Callable[[dict, dict], float],
        budget_s: float,
        cpu: CpuSampler | None = None,
    ) -> None:
        self.progress, self.reward_key, self.step_key = progress, reward_key, step_key
        self.clock, self.budget_s = clock, budget_s
        self.rewards: list[float] = []
        self.first: dict | None = None
        self.last: dict | None = None
        self.cpu = cpu  # polled with the step count at each look
        self.task = progress.add_task(label, total=None, info="starting")

    def over_budget(self) -> bool:
        return (
            self.first is not None
            and self.last is not None
            and self.clock(self.first, self.last) > self.budget_s
        )

    def __call__(self, records: list[dict]) -> bool:
        steps = [r for r in records if self.reward_key in r]
        self.rewards += [float(r[self.reward_key]) for r in steps]
        if steps:
            self.first, self.last = self.first or steps[0], steps[-1]
            mean = trailing_means(self.rewards)[-1]
            info = f"step {steps[-1][self.step_key]}  reward {self.rewards[-1]:.3f}"
            info += f"  trailing {mean:.3f}" if mean is not None else ""
            self.progress.update(self.task, info=info)
        if self.cpu is not None:
            self.cpu.poll(len(self.rewards))
        return reached(self.rewards)

    def done(self, reason: str) -> None:
        self.progress.update(self.task, info=f"{len(self.rewards)} steps, {reason}")
        self.progress.stop_task(self.task)


# -- Sluice ------------------------------------------------------------------------------------


def sluice_clock(first: dict, last: dict) -> float:
    """Seconds of a Sluice run's clock at its learner record `last`, counted from the start of
    its first step's wait for data (no later than the first generation, which the curve's clock
    starts at: the budget is spent a little sooner than the curve says)."""
    return last["time"] - (first["time"] - first["step_s"])


def trl_clock(first: dict, last: dict) -> float:
    """Seconds of a TRL run's clock (since on_train_begin) at its step record `last`."""
    return last["time_s"]


def within_budget(curve: list[dict], budget_s: float) -> list[dict]:
    """The part of a run's curve inside the clock budget both systems get."""
    return [c for c in curve if c["time_s"] <= budget_s]


def step_caps(max_steps: int | None) -> dict[str, int]:
    """Each system's cap in steps: `--max-steps` for both, else TRL_STEPS for TRL (it sizes its
    prompt dataset too) and SLUICE_STEPS for Sluice, which the budget reaches first."""
    return {"trl": max_steps or TRL_STEPS, "sluice": max_steps or SLUICE_STEPS}


def sluice_overrides(spec: dict, run_dir: Path) -> list[str]:
    lc, group = LEARNER, spec["group"]
    return [
        f"run.dir={run_dir}",
        f"run.seed={spec['seed']}",
        f"rollout.seed={spec['seed']}",
        f"model.path={spec['model_dir']}",
        "model.dtype=float32",
        f"task.name={spec['task']}",
        f"task.params={{length: {TASK_LENGTH}}}",
        f"rollout.prompts_per_batch={PROMPTS}",
        f"rollout.group_size={group}",
        f"learner.batch_size={step_batch(group)}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"rollout.temperature={TEMPERATURE}",
        f"learner.total_steps={step_caps(spec['max_steps'])['sluice']}",
        f"learner.lr={LR}",
        "learner.lr_schedule=constant",
        "learner.warmup_steps=0",
        f"learner.weight_decay={lc.weight_decay}",
        f"learner.betas=[{lc.betas[0]}, {lc.betas[1]}]",
        f"learner.adam_eps={lc.adam_eps}",
        f"learner.grad_clip={lc.grad_clip}",
        "learner.epochs=1",
        "learner.minibatches=1",
        "learner.micro_batches=1",
        "learner.loss.type=grpo",
        "learner.llm.aggregation=token",
        "learner.llm.normalize_std=true",
        f"learner.llm.adv_eps={ADV_EPS}",
        "learner.llm.kl_coef=0.0",
    ]


def run_sluice(spec: dict, progress: Progress) -> dict:
    repeat = f"-r{spec['repeat']}" if spec.get("repeat") else ""
    run_dir = Path(spec["work"]) / f"sluice-{spec['task']}-s{spec['seed']}{repeat}"
    cmd = sluice_run_cmd(
        spec["sluice_config"],
        *sluice_overrides(spec, run_dir),
        *spec["sluice_overrides"],
    )
    load_before = os.getloadavg()[0]
    with (Path(spec["work"]) / f"{run_dir.name}.log").open("w") as log:
        t_launch = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        cpu = CpuSampler(lambda: {"launcher": proc.pid, **role_pids(run_dir)}, CPU_WARMUP_STEPS)
        label = f"sluice {spec['task']} seed {run_label(spec)}"
        watcher = Watcher(progress, label, "reward_mean", "version", sluice_clock, spec["budget_s"], cpu)
        try:
            reason = watch(proc, Tail(run_dir / "metrics" / "learner.jsonl"), watcher, spec["timeout_s"])
        finally:
            stop_group(proc, grace_s=60.0)
            kill_leftover_roles(run_dir)
    watcher.done(reason)
    result = sluice_result(run_dir, t_launch, spec["budget_s"])
    if not result["curve"]:
        reason += ": " + (Path(spec["work"]) / f"{run_dir.name}.log").read_text(errors="replace")[-1500:]
    return {**result, "stop": reason, "exit_code": proc.returncode, "load_before": load_before,
            "load_after": os.getloadavg()[0], "cpu": cpu.per_step(), "command": cmd}  # fmt: skip


def sluice_result(run_dir: Path, t_launch: float, budget_s: float) -> dict:
    steps = read_jsonl(run_dir / "metrics" / "learner.jsonl")
    services = {p.stem: read_jsonl(p) for p in sorted((run_dir / "metrics").glob("rollout-*.jsonl"))}
    batches = [b for records in services.values() for b in records]
    base = {"system": "sluice", "run_dir": str(run_dir)}
    if not steps or not batches:
        return {**base, **summarize_curve([]), "curve": []}
    clock0 = min(generation_start(b) for b in batches)
    curve = within_budget(
        [
            {
                "step": r["version"],
                "time_s": r["time"] - clock0,
                "reward": r["reward_mean"],
                "tokens": r["tokens"],
            }
            for r in steps
        ],
        budget_s,
    )
    summary = summarize_curve(curve)
    until = clock0 + summary["time_s"]
    generated = sum(b["tokens"] for b in batches if b["time"] <= until)
    phases = {
        "learner": median_of(steps, ("compute_s", "compute_cpu_s", "wait_s", "sync_s", "step_s")),
        "rollout": {
            **median_of(batches, ("generate_s", "pause_s", "put_s")),
            "version_to_generate_s": version_to_generate(steps, batches),
        },
    }
    return {
        **base,
        **summary,
        "startup_s": clock0 - t_launch,
        "generated_tokens_per_s": generated / summary["time_s"] if summary["time_s"] > 0 else None,
        "first_generate_s": {k: v[0]["generate_s"] for k, v in services.items() if v},
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in steps),
        "phases": phases,
        "curve": curve,
    }


def generation_start(batch: dict) -> float:
    """When a rollout batch's generation began (its record is written after its PUT)."""
    return batch["time"] - batch["put_s"] - batch["score_s"] - batch["generate_s"]


def version_to_generate(steps: list[dict], batches: list[dict]) -> float | None:
    """Median time from the learner's record of version v (written after it published v) to
    the first generation on v: the weight-sync and admission hops on the path a step waits for
    when generation is as slow as training (docs/architecture.md, "Where a version's first
    generation waits"). None: no batch generated on a recorded version."""
    recorded = {r["version"]: r["time"] for r in steps}
    first: dict[int, float] = {}
    for b in batches:
        if b["version"] in recorded:
            first[b["version"]] = min(first.get(b["version"], math.inf), generation_start(b))
    lags = [t - recorded[v] for v, t in first.items()]
    return statistics.median(lags) if lags else None


# -- TRL ---------------------------------------------------------------------------------------


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def run_trl(spec: dict, progress: Progress) -> dict:
    """TRL in its own process (`--trl-worker`): start-up and memory are its own, like Sluice's."""
    work = Path(spec["work"])
    name = f"trl-{spec['task']}-s{spec['seed']}"
    spec = {**spec, "log": str(work / f"{name}.jsonl"), "output_dir": str(work / name)}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec, default=str))
    load_before = os.getloadavg()[0]
    with (work / f"{name}.log").open("w") as log:
        t_launch = time.time()
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(spec_path)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        cpu = CpuSampler(lambda: {"trainer": proc.pid}, CPU_WARMUP_STEPS)
        label = f"trl    {spec['task']} seed {spec['seed']}"
        watcher = Watcher(progress, label, "reward", "step", trl_clock, spec["budget_s"], cpu)
        try:
            reason = watch(proc, Tail(Path(spec["log"])), watcher, spec["timeout_s"])
            if reason == "threshold":  # it stops itself there: let it exit cleanly
                proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_group(proc, grace_s=10.0)
    watcher.done(reason)
    records = read_jsonl(Path(spec["log"]))
    begin = next((r for r in records if r.get("event") == "train_begin"), None)
    steps = [r for r in records if "reward" in r]
    curve = within_budget(
        [{k: r[k] for k in ("step", "time_s", "reward", "tokens")} for r in steps], spec["budget_s"]
    )
    if reason.startswith("exited") and not steps:
        reason += ": " + (work / f"{name}.log").read_text(errors="replace")[-1500:]
    return {
        "system": "trl",
        **summarize_curve(curve),
        "startup_s": begin["time"] - t_launch if begin else None,
        "phases": {"trainer": median_of(steps, ("generate_s", "train_s", "optim_s", "step_s"))},
        "curve": curve,
        "stop": reason,
        "exit_code": proc.returncode,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "cpu": cpu.per_step(),
    }


def trl_dataset(task, tokenizer, rows: int):
    """The task's prompts as TRL sees them, checked to tokenize exactly as Sluice's rollout does
    (`[bos] + encode(text)`: TRL calls the tokenizer on the text, which adds no specials here)."""
    from datasets import Dataset

    prompts = task.sample(rows)
    texts = [f"{tokenizer.bos_token} {p.text}" for p in prompts]
    for p, ids in zip(prompts[:16], tokenizer(text=texts[:16])["input_ids"]):
        want = [tokenizer.bos_token_id, *tokenizer.encode(p.text, add_special_tokens=False)]
        if list(ids) != want:
            raise RuntimeError(f"TRL would tokenize {p.text!r} as {ids}, Sluice as {want}")
    return Dataset.from_dict({"prompt": texts, "reference": [p.reference for p in prompts]})


def make_reward(task, eos_id: int):
    """The task's own `score`, on the text and `finished` flag the Sluice rollout would use."""
    from sluice.rollout_svc.tasks.base import Prompt

    def digits_reward(completions, completion_ids, reference, **_) -> list[float]:
        return [
            task.score(Prompt("", "", ref), text, eos_id in ids).reward
            for text, ids, ref in zip(completions, completion_ids, reference)
        ]

    return digits_reward


def grpo_config(spec: dict):
    from trl import GRPOConfig

    lc = LEARNER
    return GRPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=step_batch(spec["group"]),
        gradient_accumulation_steps=1,
        num_generations=spec["group"],
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused",
        adam_beta1=lc.betas[0],
        adam_beta2=lc.betas[1],
        adam_epsilon=lc.adam_eps,
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.grad_clip,
        loss_type="dapo",
        scale_rewards="group",
        beta=0.0,
        entropy_coef=0.0,
        num_iterations=1,
        max_steps=step_caps(spec["max_steps"])["trl"],
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=spec["seed"],
        disable_tqdm=True,
        log_completions=False,
    )


def timed_trainer(log, timing: dict[str, float], batch: int):
    """GRPOTrainer with perf_counter timers around generation and training_step, and a callback
    that logs each step and stops training at the threshold."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timing["generate_s"] += time.perf_counter() - t0
            return out

        def training_step(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            timing["training_step_s"] += time.perf_counter() - t0
            return out

    class RewardClock(TrainerCallback):
        def __init__(self) -> None:
            self.rewards: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            timing["t0"] = time.perf_counter()
            log.write({"event": "train_begin"})

        def on_step_begin(self, args, state, control, **kwargs):
            timing.update(step_t0=time.perf_counter(), generate_s=0.0, training_step_s=0.0)

        def on_step_end(self, args, state, control, **kwargs):
            timing["step_s"] = time.perf_counter() - timing["step_t0"]

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            self.rewards.append(float(logs["reward"]))
            log.write(trl_step_record(state.global_step, logs, timing, batch))
            if reached(self.rewards):
                control.should_training_stop = True

    return TimedGRPOTrainer, RewardClock()


def trl_step_record(step: int, logs: dict, timing: dict[str, float], batch: int) -> dict:
    return {
        "step": step,
        "time_s": time.perf_counter() - timing["t0"],
        "reward": float(logs["reward"]),
        "tokens": round(float(logs["completions/mean_length"]) * batch),
        "generate_s": timing["generate_s"],
        "train_s": timing["training_step_s"] - timing["generate_s"],
        "optim_s": timing["step_s"] - timing["training_step_s"],
        "step_s": timing["step_s"],
    }


def trl_worker(spec_path: Path) -> None:
    import torch

    torch.set_num_threads(TRL_THREADS)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sluice.metrics import JsonlLog

    spec = json.loads(spec_path.read_text())
    log = JsonlLog(Path(spec["log"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    task = make_task(spec["task"], spec["seed"] * TASK_SEED)
    dataset = trl_dataset(task, tokenizer, rows=PROMPTS * step_caps(spec["max_steps"])["trl"])
    timing: dict[str, float] = {}
    trainer_cls, callback = timed_trainer(log, timing, step_batch(spec["group"]))
    trainer = trainer_cls(
        model=model,
        reward_funcs=make_reward(task, tokenizer.eos_token_id),
        args=grpo_config(spec),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.train()
    log.write({"event": "end", "steps": trainer.state.global_step})
    log.close()


# -- the bound ---------------------------------------------------------------------------------


def median_time(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bound_batch(tokenizer, vocab: int, batch: int):
    """`batch` prompts of the copy task, each followed by 12 random completion tokens
    (right-padded to one width, as the learner's collate pads)."""
    import torch

    task = make_task("copy", 0)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(p.text, add_special_tokens=False)]
        for p in task.sample(batch)
    ]
    gen = torch.Generator().manual_seed(0)
    rows = [p + torch.randint(4, vocab, (MAX_NEW_TOKENS,), generator=gen).tolist() for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    completion = torch.zeros((batch, width - 1))
    for i, (p, r) in enumerate(zip(prompts, rows)):
        completion[i, len(p) - 1 : len(r) - 1] = 1  # targets that are completion tokens
    prompt_ids = torch.tensor(prompts)  # every prompt has the same length here
    return ids, mask, completion, prompt_ids


def train_step_fn(model, ids, mask, completion) -> Callable[[], None]:
    import torch

    lc = LEARNER
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=lc.betas, eps=lc.adam_eps, weight_decay=lc.weight_decay, fused=True
    )
    advantages = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(1))

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(advantages[:, None] * logp * completion).sum() / completion.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def generate_fn(model, prompt_ids) -> Callable[[], None]:
    import torch

    gen = torch.Generator().manual_seed(2)

    @torch.no_grad()
    def sample() -> None:
        out = model(input_ids=prompt_ids, use_cache=True)
        for i in range(MAX_NEW_TOKENS):
            probs = torch.softmax(out.logits[:, -1].float() / TEMPERATURE, -1)
            tok = torch.multinomial(probs, 1, generator=gen)
            if i + 1 < MAX_NEW_TOKENS:
                out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)

    return sample


def measure_bound(
    model_dir: Path, repeats: int, warmup: int, batch: int, thread_counts: tuple[int, ...] = (1, 2)
) -> dict:
    """Plain torch's train step and sampling of `batch` sequences, each the median of `repeats`,
    at each of `thread_counts` (which must hold 1: the bound per step is at one thread a phase)."""
    import torch

    from sluice.modeling import load_policy

    model, tokenizer = load_policy(model_dir)
    ids, mask, completion, prompt_ids = bound_batch(tokenizer, model.config.vocab_size, batch)
    trained = copy.deepcopy(model).train()
    model.eval()
    threads_before = torch.get_num_threads()
    out: dict[str, dict[str, float]] = {"train_s": {}, "generate_s": {}}
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            out["train_s"][str(threads)] = median_time(
                train_step_fn(trained, ids, mask, completion), repeats, warmup
            )
            out["generate_s"][str(threads)] = median_time(generate_fn(model, prompt_ids), repeats, warmup)
    finally:
        torch.set_num_threads(threads_before)
    return {
        **out,
        "bound_s_per_step": max(out["train_s"]["1"], out["generate_s"]["1"]),
        "repeats": repeats,
        "warmup": warmup,
        "sequences": batch,
        "tokens_per_sequence": int(ids.shape[1]),
    }


# -- report ------------------------------------------------------------------------------------


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def cross_cell(run: dict, thr: float) -> str:
    c = run["crossings"].get(str(thr))
    return "-" if c is None else f"{c['step']} / {c['time_s']:.0f}s"


def summarize(runs: list[dict], tasks: list[str], seeds: list[int]) -> dict:
    """Per task, a row per Sluice run (each seed's repeats) against the seed's TRL run: time and
    steps to 0.9 for each system, Sluice/TRL ratios, medians over the rows. A system that
    stopped (max steps) short of the threshold would have taken longer than its whole run:
    where only one reached it, the ratio is a bound (`censored`: Sluice/TRL is at most it when
    only Sluice reached, at least it when only TRL did). The medians and the every-seed verdicts
    err against Sluice: an upper bound counts as its value, a lower bound as larger than any
    ratio (a Sluice run that stopped short is never "faster"; a median that falls on one is
    None). `faster_every_seed_by_repeat`: the verdict for each repeat's set of runs, i.e. how
    often one pass over the seeds would have found Sluice faster on all of them."""
    out = {}
    for task in tasks:
        per_seed = [row for seed in seeds for row in seed_rows(runs, task, seed)]
        ratios = [against_sluice(r, "time_ratio") for r in per_seed if "time_ratio" in r]
        steps_ratios = [against_sluice(r, "steps_ratio") for r in per_seed if "steps_ratio" in r]
        repeats = sorted({r["repeat"] for r in per_seed})
        out[task] = {
            "per_seed": per_seed,
            "over_seeds": {
                "sluice": over_seeds(per_seed, "sluice"),
                "trl": over_seeds([r for r in per_seed if r["repeat"] == repeats[0]], "trl"),
            },
            "median_time_ratio": finite_median(ratios),
            "median_steps_ratio": finite_median(steps_ratios),
            "sluice_faster_every_seed": faster_on_all(per_seed),
            "faster_every_seed_by_repeat": [
                faster_on_all([r for r in per_seed if r["repeat"] == k]) for k in repeats
            ],
            "sluice_ahead_at_every_time": ahead_at_every_time([r for r in runs if r["task"] == task]),
        }
    return out


def reach_times(runs: list[dict], system: str) -> tuple[list[float], int]:
    """When each of `system`'s runs reached the threshold (sorted; a run that stopped short is
    absent), and how many runs it had."""
    own = [r for r in runs if r["system"] == system]
    return sorted(c["time_s"] for r in own if (c := r["crossings"].get(str(STOP_AT)))), len(own)


def reached_share(runs: list[dict], system: str, t: float) -> float:
    """The share of `system`'s runs whose trailing mean had reached the threshold by time t."""
    times, n = reach_times(runs, system)
    return bisect.bisect_right(times, t) / n if n else 0.0


def ahead_at_every_time(runs: list[dict]) -> bool | None:
    """Whether, at every wall time, at least as large a share of Sluice's runs as of TRL's had
    reached the threshold (the bottom panel of the plot; a run that stopped short never does):
    "faster" for the two distributions the seeds draw from, which a single pass over a few
    seeds only samples. None without runs of both systems."""
    if not {"sluice", "trl"} <= {r["system"] for r in runs}:
        return None
    times = {*reach_times(runs, "sluice")[0], *reach_times(runs, "trl")[0]}
    return all(reached_share(runs, "sluice", t) >= reached_share(runs, "trl", t) for t in times)


def seed_rows(runs: list[dict], task: str, seed: int) -> list[dict]:
    """One row per Sluice run of the seed (its repeats, in order), each against the seed's one
    TRL run; a single row where Sluice did not run."""
    mine = [r for r in runs if r["task"] == task and r["seed"] == seed]
    trl = next((r for r in mine if r["system"] == "trl"), None)
    sluice = sorted((r for r in mine if r["system"] == "sluice"), key=lambda r: r.get("repeat", 0))
    rows = []
    for s in sluice or [None]:
        row: dict[str, Any] = {"seed": seed, "repeat": s.get("repeat", 0) if s else 0}
        for system, r in (("sluice", s), ("trl", trl)):
            if r is not None:
                c = r["crossings"].get(str(STOP_AT))
                last = r["curve"][-1] if r["curve"] else {"time_s": None, "step": None}
                row[system] = {"time_s": c and c["time_s"], "steps": c and c["step"],
                               "ran_s": last["time_s"], "ran_steps": last["step"]}  # fmt: skip
        row.update(seed_ratios(row.get("sluice", {}), row.get("trl", {})))
        rows.append(row)
    return rows


def faster_on_all(rows: list[dict]) -> bool:
    """Whether Sluice was faster than TRL in every row (a row with no verdict counts as not)."""
    return bool(rows) and faster_counts(rows)["sluice_faster_on"] == len(rows)


def faster_counts(rows: list[dict]) -> dict[str, int]:
    """Over the rows with runs of both systems: on how many Sluice was faster, on how many TRL
    was (the verdicts `faster_on_all` reads), and on how many neither reached the threshold."""
    both = [r for r in rows if "sluice" in r and "trl" in r]
    ratios = [against_sluice(r, "time_ratio") for r in both if "time_ratio" in r]
    return {"sluice_faster_on": sum(x < 1 for x in ratios), "trl_faster_on": sum(x > 1 for x in ratios),
            "neither_reached": len(both) - len(ratios)}  # fmt: skip


def against_sluice(row: dict, key: str) -> float:
    """A seed's Sluice/TRL ratio as the medians and the verdict take it: a lower bound (Sluice
    stopped short, TRL did not) counts as larger than any ratio."""
    return math.inf if row.get("censored") == "at least" else row[key]


def finite_median(values: list[float]) -> float | None:
    m = statistics.median(values) if values else None
    return None if m is None or math.isinf(m) else m


def over_seeds(per_seed: list[dict], system: str) -> dict:
    """One system's steps and time to the threshold as a distribution over its runs (seeds and
    repeats): how many reached it, and the medians with a run that stopped short counted as
    slower than any that reached it (None when half or more stopped short). Which seeds are
    lucky is a matter of each system's own random streams, so this, not seed against seed,
    compares sample efficiency."""
    rows = [r[system] for r in per_seed if system in r]
    reached_rows = [r for r in rows if r["steps"]]

    def censored_median(key: str) -> float | None:
        return finite_median([r[key] for r in reached_rows] + [math.inf] * (len(rows) - len(reached_rows)))

    return {"runs": len(rows), "reached": len(reached_rows),
            "median_steps": censored_median("steps"), "median_time_s": censored_median("time_s")}  # fmt: skip


def seed_ratios(s: dict, t: dict) -> dict:
    """Sluice/TRL time and steps to the threshold on one seed: exact where both reached it, a
    bound where one did (module docstring of `summarize`), nothing where neither did."""
    if s.get("time_s") and t.get("time_s"):
        return {"time_ratio": s["time_s"] / t["time_s"], "steps_ratio": s["steps"] / t["steps"]}
    if s.get("time_s") and t.get("ran_s"):  # TRL stopped short: Sluice/TRL is below this
        return {"time_ratio": s["time_s"] / t["ran_s"], "steps_ratio": s["steps"] / t["ran_steps"],
                "censored": "at most"}  # fmt: skip
    if t.get("time_s") and s.get("ran_s"):  # Sluice stopped short: Sluice/TRL is above this
        return {"time_ratio": s["ran_s"] / t["time_s"], "steps_ratio": s["ran_steps"] / t["steps"],
                "censored": "at least"}  # fmt: skip
    return {}


def against_bound(runs: list[dict], bound: dict) -> list[dict]:
    """Sluice's measured seconds per step (median learner step_s, and clock time / steps) next
    to the bound per step measured around the run (the run-wide one where it has none); and the
    training thread's CPU time a step against plain torch's training step alone: above 1, the
    same arithmetic ran slower inside the run than around it (the other core's load, the VM),
    which no overhead of Sluice's explains."""
    rows = []
    for r in (r for r in runs if r["system"] == "sluice"):
        learner = r.get("phases", {}).get("learner", {})
        step_s, train_cpu = learner.get("step_s"), learner.get("compute_cpu_s")
        wall = r.get("s_per_step")
        b = r.get("bound_s_per_step", bound["bound_s_per_step"])
        train_alone = r.get("bound_train_s", bound["train_s"]["1"])
        rows.append({
            "task": r["task"], "seed": r["seed"], "repeat": r.get("repeat", 0), "bound_s_per_step": b,
            "median_step_s": step_s, "median_step_over_bound": step_s / b if step_s else None,
            "wall_s_per_step": wall, "wall_over_bound": wall / b if wall else None,
            "train_cpu_over_alone": train_cpu / train_alone if train_cpu else None,
        })  # fmt: skip
    return rows


def runs_table(runs: list[dict]) -> Table:
    table = Table(
        title=f"Steps / time to a {WINDOW}-step trailing mean reward (clock from the first generation)"
    )
    cols = [
        "system",
        "task",
        "seed",
        *(f"to {t}" for t in THRESHOLDS),
        "start-up s",
        "s/step",
        "tokens/s",
        "load before/after",
        "stop",
    ]
    for col in cols:
        table.add_column(col)
    for r in runs:
        table.add_row(
            r["system"], r["task"], str(r["seed"]), *(cross_cell(r, t) for t in THRESHOLDS),
            fmt(r.get("startup_s")), fmt(r.get("s_per_step"), ".3f"), fmt(r.get("tokens_per_s"), ".0f"),
            f"{r['load_before']:.1f} / {r['load_after']:.1f}", r.get("stop", "-"),
        )  # fmt: skip
    return table


# (column, Sluice's phase, TRL's phase): medians per learner step / rollout batch / trainer step
PHASE_COLUMNS = (
    ("generate", ("rollout", "generate_s"), ("trainer", "generate_s")),
    ("train", ("learner", "compute_s"), ("trainer", "train_s")),
    ("train on-CPU", ("learner", "compute_cpu_s"), None),
    ("optimizer", None, ("trainer", "optim_s")),
    ("step", ("learner", "step_s"), ("trainer", "step_s")),
    ("learner wait", ("learner", "wait_s"), None),
    ("weight sync", ("learner", "sync_s"), None),
    ("rollout pause", ("rollout", "pause_s"), None),
    ("version to generate", ("rollout", "version_to_generate_s"), None),
    ("put", ("rollout", "put_s"), None),
)


def phases_table(runs: list[dict], batch: int) -> Table:
    table = Table(
        title=f"Per-phase medians (s). generate: one batch of {batch} (TRL: with reward and advantages); "
        "train: Sluice forward+backward+AdamW, TRL forward+backward; train on-CPU: the CPU time of "
        "Sluice's training thread in it (the rest it waited for the GIL or a core); version to "
        "generate: from the learner's record of a version (after its publish) to the first generation on it; "
        "optimizer: TRL clip+AdamW+zero_grad"
    )
    for col in ("system", "task", "seed", *(c[0] for c in PHASE_COLUMNS)):
        table.add_column(col)
    for r in runs:
        cells = []
        for _, sluice, trl in PHASE_COLUMNS:
            where = sluice if r["system"] == "sluice" else trl
            value = r.get("phases", {}).get(where[0], {}).get(where[1]) if where else None
            cells.append(fmt(value, ".4f"))
        table.add_row(r["system"], r["task"], str(r["seed"]), *cells)
    return table


def cpu_columns(cpu: dict) -> dict[str, float | None]:
    """A run's CPU seconds per step by kind of process: the trainer's (Sluice's learner, TRL's
    one process) main thread and its other threads, the rollout services, the shards and the
    launcher (None: the run has none); `name-<i>` processes are summed by name."""
    whole: dict[str, float] = {}
    for name, seconds in cpu["cpu_s"].items():
        if not name.endswith(":main"):
            kind = name.split("-")[0]
            whole[kind] = whole.get(kind, 0.0) + seconds
    trainer = "learner" if "learner" in whole else "trainer"
    main = cpu["cpu_s"].get(f"{trainer}:main", 0.0)
    return {
        "trainer main thread": main,
        "trainer other threads": whole.get(trainer, 0.0) - main,
        "rollouts": whole.get("rollout"),
        "shards": whole.get("buffer"),
        "launcher": whole.get("launcher"),
        "total": cpu["total_s"],
    }


def cpu_table(runs: list[dict]) -> Table:
    table = Table(
        title=f"CPU seconds per step, from step {CPU_WARMUP_STEPS} to the end (cpu_use.py; trainer: Sluice's "
        "learner, whose main thread trains, or TRL's process); cores busy: total / (cores x wall per step)"
    )
    columns = ("trainer main thread", "trainer other threads", "rollouts", "shards", "launcher", "total")
    for col in ("system", "task", "seed", *columns, "wall s/step", "cores busy"):
        table.add_column(col)
    for r in runs:
        cpu = r.get("cpu")
        if not cpu:
            continue
        cells = cpu_columns(cpu)
        row = [fmt(cells[c], ".4f") for c in columns]
        table.add_row(
            r["system"], r["task"], run_label(r), *row, fmt(cpu["wall_s"], ".4f"), fmt(cpu["busy"], ".0%")
        )
    return table


def summary_table(summary: dict) -> Table:
    table = Table(title=f"Time to {STOP_AT}: Sluice / TRL")
    for col in ("task", "seed", "sluice s (steps)", "trl s (steps)", "time ratio", "steps ratio"):
        table.add_column(col)
    for task, s in summary.items():
        for row in s["per_seed"]:
            cell = {
                k: f"{fmt(row[k]['time_s'])} ({row[k]['steps'] or '-'})" if k in row else "-"
                for k in ("sluice", "trl")
            }
            mark = {"at most": "<= ", "at least": ">= "}.get(row.get("censored", ""), "")
            keys = ("time_ratio", "steps_ratio")
            ratios = tuple(mark + fmt(row.get(k), ".2f") if k in row else "-" for k in keys)
            table.add_row(task, run_label(row), cell["sluice"], cell["trl"], *ratios)
        by_repeat = s["faster_every_seed_by_repeat"]
        faster = "yes" if s["sluice_faster_every_seed"] else "no"
        if len(by_repeat) > 1:
            faster += f" (in {sum(by_repeat)} of {len(by_repeat)} repeats)"
        table.add_row(task, "median", "", "", fmt(s["median_time_ratio"], ".2f"),
                      fmt(s["median_steps_ratio"], ".2f"), end_section=True)  # fmt: skip
        table.add_row(task, "Sluice faster on every seed", faster, "", "", "", end_section=True)
        ahead = {True: "yes", False: "no", None: "-"}[s["sluice_ahead_at_every_time"]]
        table.add_row(
            task, f"share of runs at {STOP_AT} ahead at every time", ahead, "", "", "", end_section=True
        )
        dist = {k: s["over_seeds"][k] for k in ("sluice", "trl")}
        table.add_row(task, "reached / runs", *(f"{d['reached']} / {d['runs']}" for d in dist.values()))
        table.add_row(task, "median over runs", *(
            f"{fmt(d['median_time_s'])} ({fmt(d['median_steps'], '.0f')})" for d in dist.values()
        ), end_section=True)  # fmt: skip
    return table


def seed_pairs(
    runs: list[dict], tasks: list[str], thresholds: Sequence[float] = THRESHOLDS
) -> dict[str, dict]:
    """Per task, seed_pairs.py's statistics of the seeds' first runs: each threshold's paired
    steps and time ratios, and the time per step (empty pairs where TRL did not run)."""
    out = {}
    for task in tasks:
        mine = [r for r in runs if r["task"] == task]
        out[task] = {"thresholds": by_threshold(mine, list(thresholds)), "s_per_step_ratio": per_step(mine)}
    return out


def run_label(row: dict) -> str:
    """A seed, with the repeat where there are repeats: "4", "4 #2"."""
    return f"{row['seed']} #{row['repeat']}" if row.get("repeat") else str(row["seed"])


def bound_table(bound: dict) -> Table:
    table = Table(
        title=f"Bound: plain torch, {bound['sequences']} x {bound['tokens_per_sequence']} tokens (median s)"
    )
    for col in ("phase", "1 thread", "2 threads"):
        table.add_column(col)
    table.add_row("train step", fmt(bound["train_s"]["1"], ".4f"), fmt(bound["train_s"]["2"], ".4f"))
    table.add_row(
        f"generate {bound['sequences']} x {MAX_NEW_TOKENS}",
        fmt(bound["generate_s"]["1"], ".4f"),
        fmt(bound["generate_s"]["2"], ".4f"),
    )
    table.add_row("bound per step", fmt(bound["bound_s_per_step"], ".4f"), "max(train@1, generate@1)")
    return table


def against_bound_table(rows: list[dict]) -> Table:
    table = Table(title="Sluice s/step against the bound (one core per phase)")
    columns = ("task", "seed", "bound s", "median learner step s", "ratio", "clock s / steps", "ratio",
               "train on-CPU / train@1 alone")  # fmt: skip
    for col in columns:
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["task"], run_label(r), fmt(r["bound_s_per_step"], ".4f"),
            fmt(r["median_step_s"], ".4f"), fmt(r["median_step_over_bound"], ".2f"),
            fmt(r["wall_s_per_step"], ".4f"), fmt(r["wall_over_bound"], ".2f"),
            fmt(r.get("train_cpu_over_alone"), ".2f"),
        )  # fmt: skip
    return table


def plot(runs: list[dict], tasks: list[str], path: Path) -> None:
    """Reward (5-step trailing mean) vs wall time (top) and vs steps (middle), every run, and
    the share of each system's runs at the threshold by each time (bottom), one column per
    task."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(tasks), 11), layout="constrained")
    axes = fig.subplots(3, len(tasks), squeeze=False)
    colors = {"sluice": "tab:blue", "trl": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    for col, task in enumerate(tasks):
        mine = [r for r in runs if r["task"] == task]
        for r in (r for r in mine if r["curve"]):
            means = trailing_means([c["reward"] for c in r["curve"]])
            pts = [(c["time_s"], c["step"], m) for c, m in zip(r["curve"], means) if m is not None]
            if not pts:
                continue
            times, steps, values = zip(*pts)
            style = {"color": colors[r["system"]], "ls": styles[r["seed"] % len(styles)], "alpha": 0.85}
            label = f"{r['system']} seed {run_label(r)}"
            axes[0][col].plot(times, values, label=label if not r.get("repeat") else None, **style)
            axes[1][col].plot(steps, values, **style)
        for row, xlabel in enumerate(
            ("wall time since the first generation (s)", "step (optimizer updates)")
        ):
            ax = axes[row][col]
            ax.axhline(STOP_AT, color="gray", ls="--", lw=0.8)
            ax.set(xlabel=xlabel, ylabel=f"reward ({WINDOW}-step trailing mean)", ylim=(0, 1.02))
        plot_reached_by_time(axes[2][col], mine, colors)
        axes[0][col].set_title(f"{task} (length {TASK_LENGTH})")
        axes[0][col].legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_reached_by_time(ax, runs: list[dict], colors: dict[str, str]) -> None:
    """Per system, the share of its runs whose trailing mean had reached the threshold by each
    wall time (a run that stopped short never counts): the distribution the seeds draw from."""
    for system, color in colors.items():
        times, n = reach_times(runs, system)
        if not n:
            continue
        ys = [i / n for i in range(len(times) + 1)]
        ax.step([0.0, *times], ys, where="post", color=color, label=f"{system}: {len(times)} of {n} runs")
    ax.set(xlabel="wall time since the first generation (s)", ylabel=f"share of runs at {STOP_AT}",
           ylim=(0, 1.02))  # fmt: skip
    ax.legend(fontsize=7)


# -- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", nargs="+", choices=["copy", "reverse"], default=["copy", "reverse"])
    p.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help="clock seconds each run gets to reach the threshold (both systems alike)",
    )
    p.add_argument("--max-steps", type=int,
                   help=f"cap both systems at N steps (default: the budget ends a run; TRL {TRL_STEPS}, "
                   f"Sluice {SLUICE_STEPS}, module docstring)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run from launch (a safety)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_trl")
    p.add_argument("--skip-trl", action="store_true", help="run Sluice (and the bound) only")
    p.add_argument(
        "--repeats", type=int, default=1, help="Sluice runs per seed (TRL runs once: deterministic)"
    )
    p.add_argument("--group", type=int, default=GROUP,
                   help=f"completions per prompt, both systems (a step: {PROMPTS} prompts x it)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: one seed, one task, a few steps")
    p.add_argument("--sluice-config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--sluice-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `sluice run` override (repeatable), applied after the workload's")  # fmt: skip
    p.add_argument("--bound-repeats", type=int, default=20)
    p.add_argument("--keep-work", type=Path, help="keep run directories and logs here (default: a temp dir)")
    p.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be at least 1, got {args.max_steps}")
    if args.bound_repeats < 1:
        p.error(
            f"--bound-repeats must be at least 1 (the bound is a median of repeats), got {args.bound_repeats}"
        )
    if args.group < 2:
        p.error(f"--group must be at least 2 (group advantages need two completions), got {args.group}")
    if args.quick:
        args.seeds, args.tasks, args.max_steps, args.bound_repeats = args.seeds[:1], args.tasks[:1], 6, 3
        args.sluice_override = ["rollout.engine=hf", *args.sluice_override]
    return args


def run_all(args, model_dir: Path, work: Path, console: Console) -> list[dict]:
    """Every (task, seed) pair: TRL once (it is deterministic per seed), Sluice `--repeats`
    times (its sampling depends on timing); which system goes first alternates."""
    runs = []
    with Progress(TextColumn("{task.description}"), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                  console=console) as progress:  # fmt: skip
        for i, (task, seed) in enumerate((t, s) for t in args.tasks for s in args.seeds):
            spec = {
                "task": task, "seed": seed, "model_dir": str(model_dir), "work": str(work),
                "max_steps": args.max_steps, "timeout_s": args.timeout, "budget_s": args.budget,
                "group": args.group,
                "sluice_config": str(args.sluice_config), "sluice_overrides": args.sluice_override,
            }  # fmt: skip
            order = [(run_sluice, k) for k in range(args.repeats)]
            order = order if args.skip_trl else [(run_trl, 0), *order]
            for run, repeat in order if i % 2 == 0 else order[::-1]:
                result = bracketed(run, {**spec, "repeat": repeat}, progress, model_dir, args.bound_repeats)
                runs.append({"task": task, "seed": seed, "repeat": repeat, **result})
    return runs


def bracketed(run, spec: dict, progress: Progress, model_dir: Path, repeats: int) -> dict:
    """`run`, and for a Sluice run the bound measured just before and just after it: the VM's
    speed drifts by +-15% over minutes, so each run is set against the mean of the two."""
    if run is not run_sluice:
        return run(spec, progress)
    batch = step_batch(spec["group"])
    before = measure_bound(model_dir, repeats, 2, batch, (1,))
    result = run(spec, progress)
    after = measure_bound(model_dir, repeats, 2, batch, (1,))
    return {
        **result,
        "bound_s_per_step": (before["bound_s_per_step"] + after["bound_s_per_step"]) / 2,
        "bound_before_s": before["bound_s_per_step"],
        "bound_after_s": after["bound_s_per_step"],
        "bound_train_s": (before["train_s"]["1"] + after["train_s"]["1"]) / 2,
    }


def main() -> None:
    args = parse_args()
    if args.trl_worker is not None:
        return trl_worker(args.trl_worker)
    # SIGTERM unwinds like Ctrl-C, so every run's process group is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    console = Console(width=180)
    if not args.skip_trl and not trl_available():
        console.print(f"[red]{SETUP_HINT}, or pass --skip-trl")
        sys.exit(2)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    retain_freed_memory()  # the bound's process keeps freed memory as Sluice's roles do (docstring)
    with tempfile.TemporaryDirectory(prefix="sluice-vs-trl-") as tmp:
        work = args.keep_work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = work / "model"
        params = build_model_dir(model_dir)
        console.print(f"model: {params:,} parameters, {json.dumps(MODEL_INIT)} -> {model_dir}")
        with console.status("bound: plain torch train step and sampling, 1 and 2 threads"):
            bound = measure_bound(
                model_dir, args.bound_repeats, 3 if args.quick else 5, step_batch(args.group)
            )
        console.print(bound_table(bound))
        runs = run_all(args, model_dir, work, console)
    report(args, params, bound, runs, console)


def report(args, params: int, bound: dict, runs: list[dict], console: Console) -> None:
    summary = summarize(runs, args.tasks, args.seeds)
    bound_rows = against_bound(runs, bound)
    pairs = seed_pairs(runs, args.tasks)
    for table in (
        runs_table(runs),
        phases_table(runs, step_batch(args.group)),
        cpu_table(runs),
        summary_table(summary),
        *(
            pairs_table(f"{task}: Sluice / TRL seed by seed (first runs)", p["thresholds"])
            for task, p in pairs.items()
        ),
        against_bound_table(bound_rows),
    ):
        console.print(table)
    workload = {
        "model_init": MODEL_INIT, "parameters": params, "task_length": TASK_LENGTH, "prompts": PROMPTS,
        "group": args.group, "batch": step_batch(args.group), "max_new_tokens": MAX_NEW_TOKENS, "lr": LR,
        "temperature": TEMPERATURE,
        "stop_at": STOP_AT, "window": WINDOW, "thresholds": THRESHOLDS,
        "max_steps": step_caps(args.max_steps),
        "budget_s": args.budget,
        "sluice_config": str(args.sluice_config), "sluice_overrides": args.sluice_override,
        "trl_threads": TRL_THREADS, "quick": args.quick, "repeats": args.repeats,
    }  # fmt: skip
    result = {
        "workload": workload,
        "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "bound": bound,
        "sluice_vs_bound": bound_rows,
        "runs": runs,
        "summary": summary,
        "seed_pairs": pairs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vs_trl.json").write_text(json.dumps(result, indent=2, default=str))
    plot(runs, args.tasks, args.out / "vs_trl.png")
    console.print(f"wrote {args.out / 'vs_trl.json'} and {args.out / 'vs_trl.png'}")


if __name__ == "__main__":
    main()
