"""Which gymnasium environment `env.id` names: a registered gymnasium id (`CartPole-v1`,
gymnasium's own `module:EnvId` form), a name a package registers under the `sluice.envs`
entry points, or a reference (sluice/plugins.py) to an Env class or a function returning an
Env, called with `env.kwargs`. A user's creator becomes a gymnasium EnvSpec, so vectorising,
seeding and autoreset work the same as for a registered id."""

from __future__ import annotations

from typing import Any, cast

from sluice.plugins import PluginError, is_file_reference, resolve


def env_spec(env_id: str) -> Any:
    """What gymnasium.make / make_vec take for `env_id`: the id itself or an EnvSpec."""
    import gymnasium as gym
    from gymnasium.envs.registration import EnvSpec

    if env_id in gym.registry:
        return env_id
    if is_file_reference(env_id) or not _gym_module_form(env_id):
        try:
            creator = resolve(env_id, "envs", "env.id", {})
        except PluginError:
            if is_file_reference(env_id) or ":" in env_id:
                raise
            return env_id  # gymnasium's own error names the id
        if not callable(creator):
            raise PluginError(f"config error: env.id: {env_id!r} is a {type(creator).__name__}, not callable")
        return EnvSpec(id=f"sluice-{_short(env_id)}", entry_point=cast(Any, creator))
    return env_id


def _gym_module_form(env_id: str) -> bool:
    """gymnasium's `module:EnvId-v0` (import the module, then make the id it registers) as
    opposed to our `module:attr` (attr a Python name)."""
    if ":" not in env_id:
        return False
    attr = env_id.rsplit(":", 1)[1]
    return not attr.replace(".", "_").isidentifier()


def _short(env_id: str) -> str:
    return env_id.rsplit(":", 1)[-1]
