"""The loss from raw rewards, for tests that state a case as rewards: one AdvantageSource,
group_advantages, then grpo_loss with a LossOptions (what grpo/step.py does in three steps).

``gl`` is the grpo_kernels.grpo_loss module to use: the test's own, possibly reloaded under the
Triton interpreter."""

from __future__ import annotations

import torch


def source_of(gl, rewards=None, reward_components=None, component_weights=None, prefix=None):
    """The AdvantageSource of one raw source: rewards [N], components [N, K] + weights [K], or prefix."""
    given = [x for x in (rewards, reward_components, prefix) if x is not None]
    assert len(given) == 1, "a test case names one advantage source"
    if prefix is not None:
        return gl.AdvantageSource.of_prefix(prefix)
    if rewards is not None:
        return gl.AdvantageSource(rewards[:, None])
    return gl.AdvantageSource(reward_components, weights=component_weights)


def loss_of(gl, logp: torch.Tensor, mask: torch.Tensor, rewards=None, *, G: int, reward_components=None,
            component_weights=None, prefix=None, scale: str = "group", adv_eps: float = 1e-4,
            adv_std_floor: float = 0.0, old_logp=None, ref_logp=None, sampler_logp=None,
            num_active_tokens=None, backend: str = "auto", **options):
    """(loss, stats) of grpo_loss on the advantages of one raw source; ``options``: LossOptions' fields."""
    src = source_of(gl, rewards, reward_components, component_weights, prefix)
    adv = gl.group_advantages(src, G, T=logp.shape[1], scale=scale, adv_eps=adv_eps, adv_std_floor=adv_std_floor,
                              backend=backend)
    return gl.grpo_loss(logp, mask, adv, old_logp=old_logp, ref_logp=ref_logp, sampler_logp=sampler_logp,
                        num_active_tokens=num_active_tokens, options=gl.LossOptions(**options), backend=backend)
