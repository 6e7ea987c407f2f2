"""A workflow's checks and sources: the field contract checked at load, a `workflow:` value read
from a shipped name or a file, and the workflow a run without one means (docs/workflows.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sluice.config.loss import (
    GrpoLoss,
    GspoLoss,
    LLMObjectiveConfig,
    VTraceLoss,
    changed,
    check_objective,
    needs_proximal,
)
from sluice.config.workflow import (
    ALGORITHMS_DIR,
    ENV_BATCH_FIELDS,
    LLM_BATCH_FIELDS,
    LOSS_PHASE_FIELDS,
    ActorCritic,
    DropZeroVariance,
    GaeAdvantages,
    GroupAdvantages,
    KLPenalty,
    PolicyLoss,
    ProximalLogprobs,
    ReferenceLogprobs,
    UserStage,
    WorkflowConfig,
    contract,
)

if TYPE_CHECKING:
    from sluice.config.run import RunConfig


def shipped_workflows() -> list[str]:
    return sorted(p.stem for p in ALGORITHMS_DIR.glob("*.yaml"))


def read_workflow_source(value: Any) -> Any:
    """A `workflow:` value as a mapping: a shipped name or a YAML file's path is read; a mapping
    (or None) is returned as it is."""
    if not isinstance(value, str):
        return value
    path = ALGORITHMS_DIR / f"{value}.yaml" if "/" not in value and not value.endswith(".yaml") else None
    if path is None or not path.is_file():
        path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(
            f"{value!r} is neither a shipped workflow ({', '.join(shipped_workflows())}) nor a YAML file"
        )
    loaded = yaml.safe_load(path.read_text())
    if not isinstance(loaded, dict):
        raise ValueError(f"{str(path)!r}: a workflow file is a mapping (name, rollout, learner)")
    return loaded


def check_workflow(wf: WorkflowConfig, kind: str) -> None:
    """Raise ValueError naming the stage: a field read before any stage writes it, a prepare
    stage after a loss stage, a stage for the other kind of run, or no loss stage."""
    available = set(ENV_BATCH_FIELDS if kind == "env" else LLM_BATCH_FIELDS)
    in_loss = token_adv = False
    for i, stage in enumerate(wf.learner):
        where = f"workflow.learner[{i}] ({stage.stage})"
        _check_kind(stage, kind, where)
        if stage.phase == "loss" and not in_loss:
            in_loss = True
            available |= set(LOSS_PHASE_FIELDS)
        elif stage.phase == "prepare" and in_loss:
            raise ValueError(f"{where}: a prepare stage after a loss stage (prepare stages come first)")
        reads, writes = contract(stage)
        token_adv = token_adv or isinstance(stage, GaeAdvantages)
        if token_adv and isinstance(stage, PolicyLoss) and isinstance(stage.loss, GspoLoss):
            raise ValueError(
                f"{where}: gspo's ratio is per sequence; it takes per-sequence advantages, not GAE's"
            )
        for name in reads:
            if name not in available:
                so_far = ", ".join(sorted(available))
                raise ValueError(
                    f"{where} reads {name!r}, which no earlier stage writes{_later(wf, i, name)} "
                    f"(written so far: {so_far})"
                )
        if stage.phase == "loss" and writes:
            raise ValueError(f"{where}: a loss stage writes no fields (writes: {list(writes)})")
        available |= set(writes)
    if not in_loss:
        raise ValueError("workflow.learner: no loss stage (policy_loss, actor_critic or a user's loss)")


def _later(wf: WorkflowConfig, i: int, name: str) -> str:
    for j in range(i + 1, len(wf.learner)):
        if name in contract(wf.learner[j])[1]:
            return f" (workflow.learner[{j}] ({wf.learner[j].stage}) writes it, later)"
    return ""


def _check_kind(stage: Any, kind: str, where: str) -> None:
    if kind == "env":
        if not isinstance(stage, ActorCritic):
            raise ValueError(f"{where}: classic RL (rollout.kind=env) takes one stage, actor_critic")
        check_objective("env", stage.loss, LLMObjectiveConfig(), stage.classic)
        return
    if isinstance(stage, ActorCritic):
        raise ValueError(f"{where}: actor_critic is for classic RL (rollout.kind=env)")
    if isinstance(stage, PolicyLoss) and isinstance(stage.loss, VTraceLoss):
        raise ValueError(f"{where}: loss.type=vtrace is for classic RL (rollout.kind=env)")


def check_no_legacy_knobs(cfg: RunConfig) -> None:
    """With `workflow:` set, the keys it replaces must be left at their defaults (else two places
    would say what the loss is)."""
    lc = cfg.learner
    given = [f"learner.llm.{k}" for k in changed(lc.llm)] + [
        f"learner.classic.{k}" for k in changed(lc.classic)
    ]
    if lc.loss != GrpoLoss():
        given.insert(0, "learner.loss")
    if cfg.rollout.drop_zero_variance_groups:
        given.append("rollout.drop_zero_variance_groups")
    if given:
        raise ValueError(
            f"{', '.join(given)}: set by the workflow ({cfg.workflow.name if cfg.workflow else ''}); "
            "give it as a stage of the workflow instead"
        )


def effective_workflow(cfg: RunConfig) -> WorkflowConfig:
    """`cfg.workflow`, or the workflow the run's learner.loss/llm/classic keys mean."""
    if cfg.workflow is not None:
        return cfg.workflow
    lc = cfg.learner
    if cfg.rollout.kind == "env":
        return WorkflowConfig(name=lc.loss.type, learner=[ActorCritic(loss=lc.loss, classic=lc.classic)])
    llm = lc.llm
    kl = llm.kl_coef > 0
    stages: list[Any] = [ProximalLogprobs()] if needs_proximal(lc.loss) else []
    stages += [ReferenceLogprobs()] if kl else []
    stages += [GroupAdvantages(normalize_std=llm.normalize_std, eps=llm.adv_eps)]
    stages += [PolicyLoss(loss=lc.loss, aggregation=llm.aggregation)]
    if kl:
        stages.append(KLPenalty(coef=llm.kl_coef, estimator=llm.kl_estimator, aggregation=llm.aggregation))
    rollout: list[Any] = [DropZeroVariance()] if cfg.rollout.drop_zero_variance_groups else []
    return WorkflowConfig(name=str(lc.loss.type), rollout=rollout, learner=stages)


def user_stages(wf: WorkflowConfig) -> list[tuple[str, int, Any]]:
    """(workflow part, index, stage) of every stage given by reference."""
    out: list[tuple[str, int, Any]] = [
        ("rollout", i, s) for i, s in enumerate(wf.rollout) if not isinstance(s, DropZeroVariance)
    ]
    return out + [("learner", i, s) for i, s in enumerate(wf.learner) if isinstance(s, UserStage)]


def preflight_workflow(wf: WorkflowConfig) -> None:
    """The launcher's check before any process starts: every stage and custom loss the workflow
    names by reference resolves and its params validate (imports the user's code)."""
    from sluice.config.loss import CustomLoss
    from sluice.plugins import resolve_function

    for part, i, stage in user_stages(wf):
        key = f"workflow.{part}[{i}].stage"
        resolve_function(stage.stage, "stages", key, stage.params, ("workflow", part, str(i), "params"))
    for i, stage in enumerate(wf.learner):
        if isinstance(stage, PolicyLoss) and isinstance(stage.loss, CustomLoss):
            key = f"workflow.learner[{i}].loss.type"
            params_key = ("workflow", "learner", str(i), "loss", "params")
            resolve_function(stage.loss.type, "losses", key, stage.loss.params, params_key)
