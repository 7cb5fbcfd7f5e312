"""The chunked DeltaNet prefill's two parts as CUDA launches: the chunk-after-chunk states
(engine/kernels/gated_delta_states.py) and the chunk-local part (engine/kernels/gated_delta_prepare.py). Their
contracts on the CPU (the chunked rule given such functions keeps its outputs and marks), their values on CUDA."""

import mlx.core as mx
import pytest

from engine.kernels import KernelConfig, chunked_rule, on_cuda
from engine.kernels.gated_delta_chunked import chunked_gated_delta, prepare_chunks
from engine.kernels.gated_delta_prepare import chunk_prepare, fits
from engine.kernels.gated_delta_states import MAX_SHARED, chunk_states, column_block, shared_bytes
from harness.kernels.bench import delta_inputs

cuda_only = pytest.mark.cuda  # the kernel is built only on MLX's CUDA backend: skipped elsewhere (conftest)


def loop_states(u_tilde, w, k_decayed, chunk_decay, state):
    """The kernel's contract as plain MLX operations, chunk after chunk: (S^T at each chunk's start, U, final S)."""
    st = state.astype(mx.float32).swapaxes(-1, -2)
    starts, us = [], []
    for i in range(u_tilde.shape[2]):
        u = u_tilde[:, :, i] - w[:, :, i] @ st
        starts.append(st)
        us.append(u)
        st = chunk_decay[:, :, i, None, None] * st + k_decayed[:, :, i].swapaxes(-1, -2) @ u
    return mx.stack(starts, 2), mx.stack(us, 2), st.swapaxes(-1, -2)


@pytest.mark.parametrize(
    "t, masked, state_dtype", [(130, True, mx.float32), (300, False, mx.float16), (64, False, mx.float32)]
)
def test_the_chunked_rule_given_a_states_function_keeps_its_outputs_and_marks(t, masked, state_dtype):
    q, k, v, g, beta, state = delta_inputs(t, 2, 4, 32, 16, dtype=mx.float32, seed=t)
    state = (state + 0.1).astype(state_dtype)
    mask = (mx.arange(t) >= t // 3)[None] if masked else None
    counts = sorted({c for c in (17, 64, 100, 128, 256, t) if c <= t})
    ours, theirs = dict.fromkeys(counts), dict.fromkeys(counts)
    y_ref, s_ref = chunked_gated_delta(q, k, v, mx.log(g), beta, state, mask, marks=theirs)
    y, s = chunked_gated_delta(q, k, v, mx.log(g), beta, state, mask, marks=ours, states=loop_states)
    tol = 2e-3 if on_cuda() else 1e-6  # (on CUDA the two paths' float32 products run as TF32 in other shapes)
    assert mx.abs(y - y_ref).max().item() < tol
    assert mx.abs(s - s_ref).max().item() < tol
    for count in counts:
        assert ours[count].shape == theirs[count].shape, count
        assert mx.abs(ours[count] - theirs[count]).max().item() < tol, count


def test_the_column_block_divides_the_value_heads_and_fits_shared_memory():
    assert column_block(128, 128) == 32  # qwen27b's heads: 4 blocks a head
    assert column_block(128, 128, mma=True) == 32 and shared_bytes(128, 32, 1, mma=True) <= 110 << 10
    assert column_block(32, 16) == 16
    assert column_block(36, 16, mma=True) is None  # tensor-core tiles of 16 key rows
    assert column_block(30, 16) is None  # key rows copied 16 bytes at a time
    assert column_block(128, 6) is None
    assert shared_bytes(128, 32) <= MAX_SHARED
    assert column_block(512, 128) is None  # W and KD's two buffers alone past a block's shared memory


def test_the_kernels_are_settings_states_on_and_prepare_off_by_default():
    assert KernelConfig().chunk_states_kernel and not KernelConfig().chunk_prepare_kernel
    assert not KernelConfig.from_env("fast", {"ENGINE_CHUNK_STATES_KERNEL": "0"}).chunk_states_kernel
    assert KernelConfig.from_env("fast", {}).chunk_states_kernel
    assert KernelConfig.from_env("fast", {"ENGINE_CHUNK_PREPARE_KERNEL": "1"}).chunk_prepare_kernel
    for name in ("ENGINE_CHUNK_STATES_KERNEL", "ENGINE_CHUNK_PREPARE_KERNEL"):
        with pytest.raises(ValueError, match=name):
            KernelConfig.from_env("fast", {name: "yes"})


def test_the_prepare_kernel_takes_qwen_heads_and_refuses_rows_it_cannot_copy():
    assert fits(128, 128) and fits(32, 16)
    assert not fits(30, 16)
    assert not fits(1024, 128)  # q and k rows past two blocks an SM


class _Heads:
    head_k_dim, head_v_dim = 128, 128


def test_off_cuda_or_switched_off_the_rule_runs_mlx_operations():
    off = chunked_rule(_Heads(), KernelConfig(chunk_states_kernel=False))
    assert off is chunked_gated_delta
    if not on_cuda():
        assert chunked_rule(_Heads(), KernelConfig(chunk_prepare_kernel=True)) is chunked_gated_delta


def test_the_chunked_rule_given_a_prepare_function_keeps_its_outputs_and_marks():
    # (prepare_chunks is the MLX path's own chunk-local part: given explicitly it is what the kernel stands for)
    q, k, v, g, beta, state = delta_inputs(150, 2, 4, 32, 16, dtype=mx.float32, seed=3)
    mask = (mx.arange(150) >= 20)[None]
    counts = [30, 64, 128, 150]
    ours, theirs = dict.fromkeys(counts), dict.fromkeys(counts)
    y_ref, s_ref = chunked_gated_delta(q, k, v, mx.log(g), beta, state, mask, marks=theirs)
    y, s = chunked_gated_delta(
        q, k, v, mx.log(g), beta, state, mask, marks=ours, prepare=prepare_chunks, states=loop_states
    )
    tol = 2e-3 if on_cuda() else 1e-6
    assert mx.abs(y - y_ref).max().item() < tol and mx.abs(s - s_ref).max().item() < tol
    for count in counts:
        assert mx.abs(ours[count] - theirs[count]).max().item() < tol, count


def _random_chunks(b, h, n, c, dk, dv, state_dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 5)
    u_tilde = mx.random.normal((b, h, n, c, dv), key=keys[0])
    w = 0.1 * mx.random.normal((b, h, n, c, dk), key=keys[1])
    kd = 0.1 * mx.random.normal((b, h, n, c, dk), key=keys[2])
    decay = mx.random.uniform(0.3, 1.0, (b, h, n), key=keys[3])
    state = mx.random.normal((b, h, dv, dk), key=keys[4]).astype(state_dtype)
    return u_tilde, w, kd, decay, state


@cuda_only
@pytest.mark.parametrize("stages, mma", [(1, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize(
    "b, h, n, dk, dv, state_dtype",
    [
        (2, 4, 3, 32, 16, mx.float32),
        (1, 6, 16, 128, 128, mx.float16),  # qwen27b's heads, a 1,024-token chunk
        (1, 2, 1, 64, 64, mx.bfloat16),
        (3, 2, 5, 128, 128, mx.float32),
    ],
)
def test_the_kernel_gives_the_loop_s_states_to_float32_rounding(b, h, n, dk, dv, state_dtype, stages, mma):
    # (mma: the products as split TF32 on the tensor cores, float32's accuracy to a few units)
    args = _random_chunks(b, h, n, 64, dk, dv, state_dtype, seed=n)
    mx.eval(args)
    got = chunk_states(*args, stages=stages, mma=mma)
    with mx.stream(mx.cpu):  # float32 products on the CPU: no TF32
        want = loop_states(*args)
        mx.eval(want)
    for name, x, y in zip(("starts", "us", "final"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == mx.float32, name
        scale = mx.abs(y).max().item()
        assert mx.abs(x - y).max().item() <= 1e-5 * max(scale, 1.0), name


@cuda_only
def test_on_cuda_the_fast_tier_s_rule_runs_the_kernels_it_is_given():
    assert chunked_rule(_Heads(), KernelConfig()).keywords == {"states": chunk_states}
    both = chunked_rule(_Heads(), KernelConfig(chunk_prepare_kernel=True)).keywords
    assert both == {"states": chunk_states, "prepare": chunk_prepare}


@cuda_only
@pytest.mark.parametrize(
    "t, hk, hv, dk, dv, dtype, masked",
    [
        (130, 2, 4, 32, 16, mx.float32, True),
        (64, 1, 2, 64, 64, mx.bfloat16, False),
        (1024, 16, 48, 128, 128, mx.bfloat16, False),  # qwen27b's heads
        (300, 4, 8, 128, 128, mx.float16, True),
    ],
)
def test_the_prepare_kernel_gives_the_mlx_path_s_parts_to_float32_rounding(t, hk, hv, dk, dv, dtype, masked):
    q, k, v, g, beta, _ = delta_inputs(t, hk, hv, dk, dv, dtype=dtype, seed=t)
    log_g, beta = mx.log(g), beta.astype(mx.float32)
    if masked:
        keep = (mx.arange(t) >= t // 3)[None, :, None]
        log_g, beta = mx.where(keep, log_g, 0.0), mx.where(keep, beta, 0.0)
    mx.eval(q, k, v, log_g, beta)
    got = chunk_prepare(q, k, v, log_g, beta, 64)
    with mx.stream(mx.cpu):  # the MLX path's float32 products without TF32
        want = prepare_chunks(q, k, v, log_g, beta, 64)
        mx.eval(want)
    for name, x, y in zip(("u_tilde", "w", "q_decayed", "qk", "k_decayed", "chunk_decay"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == mx.float32, name
        scale = mx.abs(y).max().item()
        assert mx.abs(x - y).max().item() <= 1e-4 * max(scale, 1.0), name


@cuda_only
def test_the_prepare_kernel_compiles_once_for_prompts_of_any_length():
    from engine.kernels.cuda_source import BUILDS

    def run(t):
        q, k, v, g, beta, _ = delta_inputs(t, 2, 4, 32, 16, dtype=mx.bfloat16, seed=t)
        mx.eval(chunk_prepare(q, k, v, mx.log(g), beta.astype(mx.float32), 64))

    run(70)
    before = BUILDS.count()
    for t in (16, 200, 513):
        run(t)
    assert BUILDS.count() == before


@cuda_only
def test_prompts_of_any_length_share_one_build():
    # (the chunk count is read by the kernel, not compiled in: a first prompt of a new length compiles nothing)
    from engine.kernels.cuda_source import BUILDS

    mx.eval(chunk_states(*_random_chunks(1, 2, 3, 64, 32, 32, mx.float32, seed=1)))
    before = BUILDS.count()
    for n in (1, 4, 7):
        mx.eval(chunk_states(*_random_chunks(1, 2, n, 64, 32, 32, mx.float32, seed=n)))
    assert BUILDS.count() == before
