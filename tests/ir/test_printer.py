"""Golden output of the printer: the GRPO program as a user reads it."""

from rlgraph.algorithms import grpo, sft

GRPO = """\
{ lambda policy:policy@v reward:Reward prompts:Prompts[B,P] ; n=8 estimator='group_normalize' loss='ppo_clip' clip=0.2 clip_high=None kl=0.0 temperature=1.0 top_p=1.0 stop=() max_new_tokens=None epochs=1 micro_batch_size=None tis_cap=None .
  let a:Rollouts[N,T] = generate[n=8 temperature=1.0 top_p=1.0 max_new_tokens=None stop=()] policy prompts
      b:f32[N] = score reward a
      c:i64[N] = a.group
      d:f32[N] = group_normalize b c
      e:f32[N,1] = getitem[index=(:, None)] d
      f:f32[N,T] = a.logprobs
      g:bool[N,T] = a.mask
      h:policy@v+1 i:stats{loss,grad_norm,clip_frac,approx_kl,logprob_diff,entropy} = update[epochs=1 minibatches=1 micro_batch_size=None grad_clip=1.0 temperature=1.0 shuffle=False on_nonfinite='raise'] policy a f e g
      loss =
        { lambda lp:f32[N,T] entropy:f32[N,T] ; f:f32[N,T] e:f32[N,1] g:bool[N,T] .
          let j:f32[] k:f32[] l:f32[] = ppo_clip[clip_low=0.2 clip_high=0.2] lp f e g
              m:f32[] = logprob_diff lp f g
              n:f32[] = token_mean entropy g
              o:f32[] = detach n
          in (j, {clip_frac=k, approx_kl=l, logprob_diff=m, entropy=o}) }
      p:f32[] q:f32[] r:f32[] s:f32[] t:f32[] = rollout_stats b g
  in (state{policy=h}, {reward=p, reward/std=q, response_length/mean=r, response_length/max=s, response_length/clip_frac=t, policy=i}) }"""


def test_grpo_prints_like_a_jaxpr():
    assert str(grpo.trace()) == GRPO


def test_source_lines_on_request():
    text = sft.trace().pretty(source=True)
    assert "# rlgraph/algorithms/sft.py:" in text or "sft.py:" in text
