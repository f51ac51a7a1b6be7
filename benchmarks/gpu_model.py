"""A model of the GPU decode step, kernel by kernel, checkable without a GPU.

Each launch is described by what it reads from memory, the instructions it issues (from its
SASS: benchmarks/gpu_static.py), its occupancy (blocks an SM: from its registers, shared memory
and threads) and the chain of dependent memory round trips one of its blocks waits through
(read from its code: which loads wait on which). Its time is the slowest of three limits, plus
a launch's fixed duration t0:

- latency: waves of blocks (ceil(blocks / (SMs x occupancy))) times a block's chain, each DRAM
  round trip `dram` us, each L2 one `l2` us, its own instructions at one a clock;
- bandwidth: bytes read / the copy bandwidth (torch's device copy, measured);
- issue: its warp instructions at 4 a clock an SM, those of the integer pipe at 2.

A kernel whose loads run ahead of their use (the new GEMV: DEPTH tiles) waits a round trip
once and then max(its compute, dram / DEPTH) a tile: Little's law per warp, so the model's
bytes in flight an SM (warps x bytes each keeps loading) is what bounds its rate.

The three latencies (t0, l2, dram) are fitted to the first GPU run's profile of the kernels of
main af730b3 (gpu_check on one H200, 4 layers at Llama-2-7B's widths: q4_gemv 91 us a layer,
attention_split 62, add_rmsnorm 7 a launch, the float16 head 192; and four small kernels that
pin t0 and l2: rope_store 2.7, attention_combine 3.2, the step's begin 1.8 and take_slot 2.6);
`fit` reports the largest relative error of the four big ones (`model_error_vs_af730b3`), which
must stay within 35 % before the predictions for today's kernels mean anything. A step is its
kernels, one graph gap (`GAP` us, an assumption until a GPU measures it) between launches, and
the once-a-step kernels as the profile measured them.

A prompt's pass (`prefill`) is a sum of its parts a layer: the tensor cores' GEMMs, the
dequantization into their scratch, flash attention, the elementwise passes (bytes at the copy
bandwidth), or the host's launches where those take longer; its efficiencies are assumptions
(named below) until a GPU's profile of a pass (gpu_check's `prefill_at`) fits them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    name: str
    sms: int
    clock_ghz: float
    copy_gb_s: float         # the bandwidth a step's bytes are measured against
    regs: int = 65536        # an SM's
    threads: int = 2048
    blocks: int = 32
    smem: int = 227 * 1024


# H200: torch's copy measured on the first GPU run; Jetson AGX Orin (sm_87): its datasheet's
# 204.8 GB/s, 16 SMs at 1.3 GHz, 1536 threads and 164 KB of shared memory an SM
H200 = Machine("H200", 132, 1.98, 4237.6)
ORIN = Machine("Jetson AGX Orin", 16, 1.3, 204.8, threads=1536, blocks=16, smem=164 * 1024)
MACHINES = {"h200": H200, "orin": ORIN}


@dataclass(frozen=True)
class Latency:
    t0: float                # us: a launch's fixed duration (profiled)
    l2: float                # us: a dependent L2 round trip, under load
    dram: float              # us: a dependent DRAM round trip, under load


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as the model sees it."""

    name: str
    blocks: int
    threads: int
    registers: int
    smem: int                # bytes a block
    dram: float = 0          # a block's chain: DRAM round trips
    l2: float = 0            # L2 round trips
    clocks: float = 0        # its own instructions, one a clock
    bytes: float = 0         # read from memory, the whole launch
    instructions: float = 0  # warp instructions, the whole launch
    integer: float = 0       # of them, on the integer pipe (half rate)
    per_warp: float = 0      # bytes a warp keeps in flight (its loads ahead)
    ahead_l2: float = 0      # L2 round trips made while its first DRAM one is out (staging x
                             # while the first codes load): the longer of the two counts
    paced: int = 0           # turns after the first that load `depth` turns ahead: each
    pace_clocks: float = 0   # max(its compute, dram / depth)
    depth: int = 1

    def chain_us(self, m: Machine, lat: Latency) -> float:
        """A block's chain of dependent round trips and its own instructions, in us."""
        clock = m.clock_ghz * 1e3
        l2 = lat.l2 * H200.clock_ghz / m.clock_ghz     # (an L2 trip's clocks, as an H200's)
        us = self.dram * lat.dram + self.l2 * l2 + self.clocks / clock
        if self.ahead_l2:
            us += max(self.ahead_l2 * l2, lat.dram)
        return us + self.paced * max(self.pace_clocks / clock, lat.dram / self.depth)

    def occupancy(self, m: Machine) -> int:
        """Blocks an SM holds (registers allocated 8 a thread at a time, 256 a warp)."""
        regs = -(-self.registers // 8) * 8 * self.threads
        return max(1, min(m.threads // self.threads, m.regs // max(regs, 1), m.blocks,
                          m.smem // max(self.smem, 1)))

    def in_flight(self, m: Machine) -> float:
        """Bytes in flight an SM: resident warps times the bytes each keeps loading."""
        return self.occupancy(m) * self.threads // 32 * self.per_warp


def time_us(k: Launch, m: Machine, lat: Latency) -> float:
    """A launch's duration: t0 plus the slowest of latency, bandwidth and issue (t0 and L2
    trips in clocks as an H200's; a DRAM round trip the same us everywhere: assumed)."""
    clock = m.clock_ghz * 1e3                          # clocks a us
    waves = math.ceil(k.blocks / (m.sms * k.occupancy(m)))
    issue = max(k.instructions / 4, k.integer / 2) / (min(m.sms, k.blocks) * clock)
    return lat.t0 * H200.clock_ghz / m.clock_ghz + max(
        waves * k.chain_us(m, lat), k.bytes / (m.copy_gb_s * 1e3), issue)


# -- the kernels of main af730b3 (the ones the first GPU run profiled) ---------------------------
# Their SASS facts (gpu_static.py at af730b3, sm_90): registers, and the instructions of each
# inner loop's turn (integer-pipe ones in parentheses)
AF730B3 = {"q4_gemv": dict(registers=64, loop=151, integer=55),
           "attention_split": dict(registers=80, score=123, value=211),
           "add_rmsnorm": dict(registers=32),
           "gemv": dict(registers=32, loop=117, integer=90)}


def af730b3_q4_gemv(rows: int, n_in: int, act: bool) -> Launch:
    """A warp per two rows (act: an output's gate and up), 8 warps a block, x staged in slabs
    of 8 tiles of 512 inputs (a barrier, then L2 loads 4 at a time); each tile's codes loaded
    and then used (a DRAM round trip a tile: no loads ahead); split in two below 1024 row
    blocks (the last split's sums read back from L2)."""
    f = AF730B3["q4_gemv"]
    tiles = -(-n_in // 512)
    row_blocks = -(-rows // 16)
    splits = 2 if row_blocks < 1024 and tiles >= 2 else 1
    share = -(-tiles // splits)
    slabs = [min(8, share - s) for s in range(0, share, 8)]
    return Launch("q4_gemv", row_blocks * splits, 256, f["registers"], 17408,
                  dram=share, l2=sum(-(-n // 4) for n in slabs) + (2 if splits > 1 else 0),
                  clocks=share * f["loop"] + 200, bytes=rows * n_in * (0.5 + 4 / 128),
                  instructions=rows / 2 * tiles * f["loop"],
                  integer=rows / 2 * tiles * f["integer"], per_warp=2 * 256)


def af730b3_attention(ctx: int, heads: int, D: int) -> Launch:
    """A block per (head, split of >= 64 slots); its 4 warps a slot at a time: the slot's
    position (L2) then its K row (DRAM), a 5-shuffle sum; then each thread a channel over the
    split's slots, 4 at a time: their scores back from L2, then their V (DRAM)."""
    f = AF730B3["attention_split"]
    chunk = max(-(-ctx // 16), 64)
    splits = -(-ctx // chunk)
    turns = -(-min(chunk, ctx) // 4)
    return Launch("attention_split", heads * splits, 128, f["registers"], 512,
                  dram=2 * turns, l2=2 * turns,
                  clocks=turns * (f["score"] + 150) + turns * f["value"] + 300,
                  bytes=heads * ctx * D * 2 * 2, instructions=heads * splits * 4 * turns * 300)


def af730b3_rmsnorm(H: int) -> Launch:
    """One block of up to 1024 threads for a decode step's row: x += d then each square,
    serialized by the stores (x may alias d: each element's loads wait for the last store),
    a block reduction, then y = x inv w, serialized the same way (w from DRAM)."""
    per = -(-H // 1024)
    return Launch("add_rmsnorm", 1, 1024, AF730B3["add_rmsnorm"]["registers"], 4096,
                  l2=per, dram=per, clocks=10 * 40 + 400, bytes=H * 4 * 4)


def af730b3_head(vocab: int, H: int) -> Launch:
    """The float16 head: a warp per row, 8 rows a block, each lane every 32nd input, 4 at a
    time (the loop unrolled: 4 loads, then their use), its 64-bit index arithmetic mostly on
    the integer pipe."""
    f = AF730B3["gemv"]
    turns = -(-H // (32 * 4))
    return Launch("gemv", -(-vocab // 8), 256, f["registers"], 1024, dram=turns,
                  clocks=turns * f["loop"], bytes=vocab * H * 2,
                  instructions=vocab * turns * f["loop"], integer=vocab * turns * f["integer"],
                  per_warp=4 * 64)


# the first GPU run's profile (gpu_check, captured graph, 4 layers of Llama-2-7B's widths at a
# context of ~80): microseconds
MEASURED_AF730B3 = {"q4_gemv": 91.0, "attention_split": 62.0, "add_rmsnorm": 7.0, "gemv": 192.0}
# the once-a-step kernels there (microseconds a step): the step's bookkeeping, the embedding's
# lookup, the sampler's argmax and the token's copies
STEP_FIXED_US = 1.81 + 2.56 + 2.24 + 4.25 + 2.12 + 12.03 + 1.59 + 1.42
GAP = 1.0      # us between two launches of a captured graph (assumed: not yet measured)

LLAMA2_7B = dict(H=4096, I=11008, L=32, Q=32, G=32, D=128, V=32000)
LLAMA3_8B = dict(H=4096, I=14336, L=32, Q=32, G=8, D=128, V=128256)
SHAPES = {"7b": LLAMA2_7B, "8b": LLAMA3_8B}


def af730b3_layer(s: dict, ctx: int) -> dict[str, list[Launch]]:
    """A decode layer's launches of the af730b3 kernels, by kernel."""
    H, I, Q, G, D = s["H"], s["I"], s["Q"], s["G"], s["D"]
    return {"q4_gemv": [af730b3_q4_gemv((Q + 2 * G) * D, H, False),
                        af730b3_q4_gemv(H, Q * D, False),
                        af730b3_q4_gemv(2 * I, H, True), af730b3_q4_gemv(H, I, False)],
            "attention_split": [af730b3_attention(ctx, Q, D)],
            "add_rmsnorm": [af730b3_rmsnorm(H)]}


def af730b3_times(lat: Latency, m: Machine = H200) -> dict[str, float]:
    """The af730b3 kernels' predicted times as the profile states them (q4_gemv and attention a
    layer, add_rmsnorm a launch, the head a step), at 7B's widths and a context of 80."""
    layer = af730b3_layer(LLAMA2_7B, 80)
    out = {name: sum(time_us(k, m, lat) for k in ks) for name, ks in layer.items()}
    out["gemv"] = time_us(af730b3_head(LLAMA2_7B["V"], LLAMA2_7B["H"]), m, lat)
    return out


# small launches of that profile (us): their chains are a few L2 trips, so they pin t0 and l2
SMALL_AF730B3 = {"rope_store": (Launch("rope_store", 64, 128, 56, 4096, l2=2, clocks=300), 2.69),
                 "attention_combine": (Launch("attention_combine", 32, 128, 48, 1024, l2=3,
                                              clocks=500), 3.21),
                 "begin": (Launch("begin", 1, 1, 24, 0, l2=3, clocks=100), 1.81),
                 "take_slot": (Launch("take_slot", 1, 1, 27, 0, l2=1, clocks=32 * 30), 2.56)}


def fit() -> tuple[Latency, float, float, dict]:
    """The latencies that best fit the af730b3 profile (the largest relative error of its eight
    kernels made least, on a grid), the largest error of its four big kernels and of all eight,
    and each big kernel's prediction."""
    best = None
    grid = itertools.product(_steps(0.5, 3.0, 0.05), _steps(0.1, 1.0, 0.05),
                             _steps(0.5, 3.0, 0.05))
    for t0, l2, dram in grid:
        if l2 > dram:                    # (an L2 round trip is the shorter)
            continue
        lat = Latency(t0, l2, dram)
        got = af730b3_times(lat)
        big = max(abs(got[k] / v - 1) for k, v in MEASURED_AF730B3.items())
        small = max(abs(time_us(k, H200, lat) / v - 1) for k, v in SMALL_AF730B3.values())
        if best is None or max(big, small) < best[2]:
            best = lat, big, max(big, small), got
    return best


def _steps(lo: float, hi: float, step: float) -> list[float]:
    return [round(lo + i * step, 4) for i in range(int(round((hi - lo) / step)) + 1)]


# -- today's kernels ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sass:
    """What gpu_static.py reads of today's kernels' SASS (sm_90) for the model."""

    gemv: dict               # bits -> {registers, unit (instructions a unit), integer}
    attention: dict          # "RQxCH" -> {registers, slot (instructions a slot a warp), integer}


def gemv_launch(sass: Sass, m: Machine, rows: int, n_in: int, bits: int = 4,
                act: bool = False, norm: bool = False) -> Launch:
    """Today's GEMV (kernels/cuda/gemv.py) of a layer of `rows` rows (act: a gate|up pair's):
    stream-K, the grid the GPU's resident blocks once (launchers.gemv_grid: BLOCKS_PER_SM an
    SM), each an equal share of the layer's units (a tile of a row block of WARPS R rows); a
    block stages its slab of x (its chunks 16 loads at a time; normed: the whole row's sum of
    squares first, a block reduction, a second pass) while its first DEPTH units' codes load;
    then a unit each max(compute, dram / DEPTH) as its codes arrive; each row block it leaves
    or shares a flush (the warps' sums; shared: parts to L2, a count, the last's sum of
    them)."""
    from tinyrt.kernels.cuda import gemv, launchers

    f = sass.gemv[bits]
    per = 64 // bits
    tiles = -(-n_in // (32 * per))
    staged = 32 * gemv.stride(bits) * 8
    slabs, share = launchers.gemv_slabs(tiles, staged)
    threads = 32 * gemv.WARPS
    blocks = max(1, m.sms * gemv.BLOCKS_PER_SM // slabs) * slabs
    row_blocks = -(-rows // (gemv.WARPS * gemv.R))
    units = -(-row_blocks * share // (blocks // slabs))       # a block's
    flushes = -(-units // share) + 1
    stage = -(-share * 32 // threads)
    if norm:                   # (every chunk of the row for the sum, then the block's again)
        stage += -(-n_in // per // threads) + 1
    return Launch(f"q{bits}_gemv" if bits < 16 else "f16_gemv", blocks, threads,
                  f["registers"], share * staged, l2=2 * flushes,
                  clocks=f["unit"] + flushes * 600,
                  bytes=rows * n_in * (bits / 8 + (bits < 16) / 32),
                  instructions=rows / gemv.R * tiles * f["unit"],
                  integer=rows / gemv.R * tiles * f["integer"],
                  per_warp=gemv.DEPTH * gemv.R * 8 * 32, ahead_l2=stage, paced=units - 1,
                  pace_clocks=f["unit"], depth=gemv.DEPTH)


def attention_launch(sass: Sass, m: Machine, ctx: int, Q: int, G: int, D: int) -> Launch:
    """Today's attention (kernels/cuda/attention.py), one query: a block per (KV head, group of
    up to 8 query heads, split), its warps U slots at a time, every load of them out at once
    and then used (a DRAM round trip a turn); the splits as launchers.attention_splits makes
    them for this machine's SMs (one wave); the last split merges them all from L2."""
    from tinyrt.kernels.cuda import attention

    rq = attention.kernel_for(Q // G, D)[1]
    f = sass.attention[f"{rq}x{-(-D // 32)}"]
    heads = G * attention.head_blocks(Q // G, rq)
    splits = max(1, min(attention.SPLIT_MAX, m.sms * attention.blocks_per_sm(rq, D) // heads))
    chunk = max(-(-ctx // splits), attention.SPLIT_MIN)
    live = -(-ctx // chunk)
    u = 4 if rq <= 4 else 2
    turns = -(-chunk // (attention.WARPS * u))
    return Launch(f"attention_{rq}x{-(-D // 32)}", heads * live, 32 * attention.WARPS,
                  f["registers"], 4 * attention.WARPS * rq * D + 1024,
                  dram=turns, l2=1 + 1 + 3, clocks=turns * f["slot"] * u + 600,
                  bytes=G * ctx * D * 2 * 2,
                  instructions=heads * live * attention.WARPS * turns * f["slot"] * u,
                  integer=heads * live * attention.WARPS * turns * f["integer"] * u,
                  per_warp=u * 2 * D * 2)


def rope_store_launch(Q: int, G: int, D: int) -> Launch:
    """rope_store (unchanged since af730b3): a block per head, its q|k|v values from L2, rotated,
    stored."""
    return Launch("rope_store", Q + G, 128, 56, 4096, l2=1, clocks=300,
                  bytes=(Q + 2 * G) * D * 4)


def step(sass: Sass, m: Machine, lat: Latency, s: dict, ctx: int) -> dict:
    """A decode step of today's kernels at shape s and context ctx (the cache holding ctx + 64
    slots: the middle of a 128-token reply): each kernel's microseconds a layer, the step's,
    its tok/s and share of the copy bandwidth, as gpu.py counts bytes (the 4-bit layers, the
    8-bit head, the K/V read)."""
    H, I, Q, G, D, V, L = (s[k] for k in "HIQGDVL")
    span = ctx + 64
    layer = [gemv_launch(sass, m, (Q + 2 * G) * D, H, norm=True),
             rope_store_launch(Q, G, D),
             attention_launch(sass, m, span, Q, G, D),
             gemv_launch(sass, m, H, Q * D),
             gemv_launch(sass, m, 2 * I, H, act=True, norm=True),
             gemv_launch(sass, m, H, I)]
    names = ["qkv (norm) gemv", "rope_store", "attention", "o gemv",
             "gate|up (norm, act) gemv", "down gemv"]
    us = {n: time_us(k, m, lat) for n, k in zip(names, layer)}
    head = time_us(gemv_launch(sass, m, V, H, bits=8, norm=True), m, lat)
    launches = L * len(layer) + 1 + 8          # (the head, the step's bookkeeping, sampler)
    total = L * sum(us.values()) + head + STEP_FIXED_US + launches * GAP
    weights = (L * (H * (Q + 2 * G) * D + H * Q * D + 3 * H * I) * (0.5 + 1 / 32)
               + V * H * (1 + 1 / 4096))
    kv = L * G * D * 2 * 2 * span
    tok_s = 1e6 / total
    return {"kernels_us_per_layer": {n: round(v, 2) for n, v in us.items()},
            "head_us": round(head, 1), "fixed_us": round(STEP_FIXED_US + launches * GAP, 1),
            "step_us": round(total, 1), "tok_s": round(tok_s, 1),
            "pct_copy_bw": round(100 * (weights + kv) * tok_s / (m.copy_gb_s * 1e9), 1)}


# -- a prompt's pass (kernels/cuda/prompt.py): assumptions until a GPU measures it -------------
TC_TFLOPS = 989.0    # an H200's dense 16-bit tensor-core peak
GEMM_EFF = 0.65      # cuBLAS's share of it at a prompt's shapes (M >= 512, N and K >= 4096)
ATTN_EFF = 0.4       # flash attention's (causal, head dim 128), of the same peak
COPY_EFF = 0.8       # an elementwise or dequantizing kernel's share of the copy bandwidth
HOST_US = 12.0       # the host's time a launch (torch's ops ~8 us, Numba's ~25)
PROMPT_LAUNCHES = 27  # a layer's launches in a pass (backend.linear, attention, the rest)
# bytes a token a layer of the passes besides GEMMs and attention (read + written, float32
# activations, 16-bit operands): coefficients of H, Q D, G D and I; from the ops a layer
# runs (the norms, operand casts, RoPE, the K/V store, the queries' scale and cast, the output's
# float32 copy, residual adds, SiLU-mul)
ELEMENTWISE = dict(H=52, QD=42, GD=20, I=18)
TRANSFORMERS_AF730B3 = {512: 14336.0, 4096: 31995.7}   # tok/s, float16, 7B shape, one H200


def prefill(m: Machine, s: dict, T: int, pass_tokens: int = 4096) -> dict:
    """A T-token prompt into an empty cache at shape s: each part's milliseconds, the TTFT
    (the host's launches overlapping the GPU's work, a layer at a time), tok/s."""
    H, I, Q, G, D, L = (s[k] for k in "HIQGDL")
    params = H * (Q + 2 * G) * D + Q * D * H + 3 * H * I          # a layer's weights
    passes = -(-T // pass_tokens)
    bw = m.copy_gb_s * 1e9 * COPY_EFF
    part = {"gemm": 2 * T * params / (TC_TFLOPS * 1e12 * GEMM_EFF),
            "dequantize": passes * params * (0.5 + 1 / 32 + 2) / bw,
            "attention": 4 * Q * D * T * T / 2 / (TC_TFLOPS * 1e12 * ATTN_EFF),
            "elementwise": T * sum(ELEMENTWISE[k] * v for k, v in
                                   (("H", H), ("QD", Q * D), ("GD", G * D), ("I", I))) / bw}
    gpu = sum(part.values())                                        # a layer's, seconds
    host = passes * PROMPT_LAUNCHES * HOST_US * 1e-6
    ttft = L * max(gpu, host)
    return {**{f"{k}_ms": round(1e3 * L * v, 2) for k, v in part.items()},
            "host_ms": round(1e3 * L * host, 2), "ttft_ms": round(1e3 * ttft, 1),
            "tok_s": round(T / ttft, 1)}


def predictions(sass: Sass) -> dict:
    """The fit to af730b3's profile, and today's step on each machine, shape and context."""
    lat, err, err_all, got = fit()
    out = {"latency_us": vars(lat), "gap_us": GAP,
           "af730b3": {k: {"predicted": round(got[k], 1), "measured": v}
                       for k, v in MEASURED_AF730B3.items()},
           "model_error_vs_af730b3": round(err, 3), "fit_error_all": round(err_all, 3),
           "machines": {}}
    for key, m in MACHINES.items():
        out["machines"][key] = {name: {ctx: step(sass, m, lat, s, ctx) for ctx in (512, 4096)}
                                for name, s in SHAPES.items()}
    out["prefill"] = {name: {T: prefill(H200, s, T) for T in (512, 4096)}
                      for name, s in SHAPES.items()}
    out["prefill_ratio_vs_transformers_7b"] = {
        T: round(out["prefill"]["7b"][T]["tok_s"] / hf, 2) for T, hf in TRANSFORMERS_AF730B3.items()}
    # on an H200, by gpu.py's model names (gpu_summary sets them beside the measurements)
    out["models"] = {name: {str(T): {**out["machines"]["h200"][shape][T],
                                     "prefill_tok_s": out["prefill"][shape][T]["tok_s"],
                                     "ttft_ms": out["prefill"][shape][T]["ttft_ms"]}
                            for T in (512, 4096)}
                     for name, shape in (("llama2-7b", "7b"), ("llama3-8b", "8b"))}
    qkv = gemv_launch(sass, H200, 3 * 4096, 4096, norm=True)
    out["q4_gemv_bytes_in_flight_per_sm"] = qkv.in_flight(H200)
    return out
