import torch
from hypothesis import given, strategies as st

from rlgraph.ir import specs as S


def test_spec_printing():
    assert str(S.f32(S.N, S.T)) == "f32[N,T]"
    assert str(S.boolean(S.B, S.P)) == "bool[B,P]"
    assert str(S.TensorSpec((), torch.float32)) == "f32[]"
    assert str(S.ROLLOUTS) == "Rollouts[N,T]" and str(S.PROMPTS) == "Prompts[B,P]"
    assert str(S.ModelSpec("policy")) == "policy@v"
    assert str(S.ModelSpec("policy").next().next()) == "policy@v+2"


def test_witness_sizes_are_distinct_and_N_is_B_times_n():
    sizes = list(S.WITNESS.values())
    assert len(set(sizes)) == len(sizes)
    assert S.WITNESS[S.N] == S.WITNESS[S.B] * S.WITNESS[S.n]


def test_witness_round_trip_including_products():
    for spec in [S.f32(S.N, S.T), S.i64(S.B, S.P), S.f32(S.N, 1), S.TensorSpec((Dim := S.Dim("N*T"),), torch.float32)]:
        assert S.spec_of_tensor(spec.witness()) == spec
    del Dim


@given(st.sampled_from([S.N, S.T, S.P, S.B]), st.sampled_from([S.N, S.T, S.P, S.B]))
def test_broadcast_mismatch_matches_symbolic_dims(a, b):
    x, y = S.f32(S.N, a).witness(), S.f32(S.N, b).witness()
    try:
        result = S.spec_of_tensor(x + y)
    except RuntimeError:
        assert a != b
    else:
        assert a == b and result == S.f32(S.N, a)


def test_bytes_of_a_spec():
    assert S.f32(S.N, S.T).nbytes({"N": 256, "T": 16}) == 256 * 16 * 4
    assert S.boolean(S.N).nbytes({"N": 8}) == 8
