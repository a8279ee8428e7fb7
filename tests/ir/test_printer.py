"""Golden output of the printer: the GRPO program as a user reads it."""

from rlgraph.algorithms import grpo, sft

GRPO = """\
{ lambda policy:policy@v reward:Reward prompts:Prompts[B,P] ; n=8 clip=0.2 clip_high=None kl=0.0 temperature=1.0 max_new_tokens=None epochs=1 micro_batch_size=None .
  let a:Rollouts[N,T] = generate[n=8 temperature=1.0 top_p=1.0 max_new_tokens=None] policy prompts
      b:f32[N] = score reward a
      c:i64[N] = a.group
      d:f32[N] = group_normalize b c
      e:f32[N,1] = getitem[index=(:, None)] d
      f:f32[N,T] = a.logprobs
      g:bool[N,T] = a.mask
      h:policy@v+1 i:stats{loss,grad_norm,clip_frac} = update[epochs=1 minibatches=1 micro_batch_size=None grad_clip=1.0 temperature=1.0 shuffle=False] policy a f e g
      loss =
        { lambda lp:f32[N,T] ; f:f32[N,T] e:f32[N,1] g:bool[N,T] .
          let j:f32[N,T] = sub lp f
              k:f32[N,T] = exp j
              l:f32[N,T] = mul k e
              m:f32[N,T] = clamp k 0.8 1.2
              n:f32[N,T] = mul m e
              o:f32[N,T] = minimum l n
              p:f32[N,T] = neg o
              q:bool[N,T] = lt k 0.8
              r:bool[N,T] = gt k 1.2
              s:bool[N,T] = or q r
              t:f32[N,T] = float s
              u:f32[] = token_mean p g
              v:f32[] = token_mean t g
          in (u, {clip_frac=v}) }
      w:f32[] = mean b
  in (state{policy=h}, {reward=w, policy=i}) }"""


def test_grpo_prints_like_a_jaxpr():
    assert str(grpo.trace()) == GRPO


def test_source_lines_on_request():
    text = sft.trace().pretty(source=True)
    assert "# rlgraph/algorithms/sft.py:" in text or "sft.py:" in text
