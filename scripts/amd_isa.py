#!/usr/bin/env python3
"""Per-kernel facts of the AMD device code, read from clang's ISA, and the design choices CI asserts on them.

No AMD GPU is reachable, so the ISA is the evidence: scripts/compile_kernels.sh compiles every kernel file
for gfx942 (MI300X) and gfx950 (MI350X) to assembly, and this script reads, for every kernel (template
instance), the code-object metadata (amdhsa.kernels: registers, LDS, scratch, spills, wave size, workgroup
bound) and the instructions of its body (global atomics, MFMA, DPP and permutes, each with the loop depth
that LLVM's loop comments give its basic block). It prints one table, writes it as markdown, and fails on
any kernel that breaks an expectation of EXPECT below.

  amd_isa.py DIR            DIR/<target>/*.s (and DIR/<target>/lds_probe.s, the attention kernels' dynamic
                            LDS); writes DIR/amd_isa.md; exit status 1 on a failed expectation
  amd_isa.py DIR --docs F   also rewrites the generated section of F (docs/amd.md)
  --partial                 only some kernel files were compiled: an entry may match no kernel
"""
import argparse
import collections
import math
import os
import re
import shutil
import subprocess
import sys

# ---- targets ----------------------------------------------------------------------------------------------
# CDNA2/3/4 have a unified register file of 512 32-bit registers per lane per SIMD, shared by VGPRs and
# AGPRs (a kernel's AGPRs start at its accum_offset), allocated in granules of 8, and at most 8 waves per
# SIMD; 4 SIMDs per CU. LDS per CU: 64 KB on gfx942, 160 KB on gfx950.
TARGETS = {
    "gfx942": {"lds_per_cu": 64 * 1024, "regs": 512, "granule": 8, "max_waves": 8, "part": "MI300X"},
    "gfx950": {"lds_per_cu": 160 * 1024, "regs": 512, "granule": 8, "max_waves": 8, "part": "MI350X"},
}
SIMDS_PER_CU = 4

# ---- expectations ---------------------------------------------------------------------------------------------
# Every kernel of the device code must match exactly one entry (`match`: a regex searched in the short
# name, see short_name()), and every entry must match at least one kernel: a new or renamed kernel has to
# state what is expected of it. Fields:
#   row          regex whose groups, joined, name the table row (default: the kernel's function name)
#   min_waves    occupancy floor, waves per SIMD (or a {target: floor} dict), with `reason`
#   hot          no scratch memory: no private segment, no VGPR spilled to memory, no dynamic stack
#                (default True; False only for ablation builds). SGPR spills are reported, not failed:
#                they go to VGPR lanes (v_writelane / v_readlane), not to memory.
#   no_atomics   no global atomic instruction at all
#   max_atomics  at most this many global atomic instructions, none inside a loop (loop depth 0): each
#                thread issues each at most once per launch, whatever the element count;
#                max_loop_atomics of them may sit in a loop (an error path, say), stated in `reason`
#   cache        the atomics sit behind a register cache (see check_cache)
#   mfma         every MFMA matches this regex ({T}: bf16 or f16, from the kernel's element type) and at
#                least one sits inside a loop
# Wave size 64 and LDS within the target's limit are asserted for every kernel.
EXPECT = [
    # -- attention (HSTU and GDPA share the kernels; the last template argument is the variant) --
    dict(match=r"^attention_forward_kernel<", row=r"^(attention_forward_kernel)<\w+, (\d+)",
         mfma=r"^v_mfma_f32_16x16x16_{T}$", min_waves={"gfx942": 1, "gfx950": 2},
         reason="one k/v stage (up to 34 KB of LDS per 4-wave workgroup, FwdConfig): one workgroup per CU "
                "fits gfx942's 64 KB at head dim 128/256; on gfx950 a second one hides one's staging "
                "behind the other's MFMA"),
    dict(match=r"^attention_backward_kernel<", row=r"^(attention_backward_kernel)<\w+, (\d+)",
         mfma=r"^v_mfma_f32_16x16x16_{T}$", min_waves=1,
         reason="k, one q/dO stage and dS take up to 60 KB of LDS per 4-wave workgroup (BwdConfig): one "
                "workgroup per CU on gfx942 (64 KB), two on gfx950 (160 KB)"),
    dict(match=r"^convert_grad_q_kernel<", min_waves=4, no_atomics=True,
         reason="a streaming fp32 -> 16-bit conversion: waves hide the loads"),
    dict(match=r"^validate_offsets_kernel\b", min_waves=4, max_atomics=9,
         reason="one block striding over the sequences, a block minimum per check (the CPU's first error); "
                "each recorded error (four checks per offsets tensor, inlined apart, and num_targets) claims "
                "the device error record with one compare-and-swap, error path only"),
    dict(match=r"^build_schedule_kernel\b", min_waves=4, max_atomics=9,
         reason="the attention tile schedule: one block per level, a block sum and a block scan over the "
                "sequences give every pair its place, deterministic, no atomics; one more block runs the "
                "offsets check (validate_offsets_kernel's code, inlined: its compare-and-swaps, error path "
                "only)"),
    dict(match=r"^check_blocks_kernel\b", min_waves=4, max_atomics=1,
         reason="_check_blocks: one block strides over the blocks, a block minimum, the lowest bad one to the "
                "device error record (one compare-and-swap, error path only)"),
    # -- bounds check --
    dict(match=r"^prepare_offsets_kernel<", min_waves=4, max_atomics=2,
         reason="one thread per bag, memory bound: waves hide the offsets' latency; one count atomic and "
                "one ticket per block"),
    dict(match=r"^check_indices_kernel<(?!.*, true>)", min_waves=4, max_atomics=2,
         reason="the index pass keeps 4 16-byte vectors in flight per thread and 4 waves per SIMD "
                "(bounds_check.cu); the count is reduced to one atomic per block, plus the ticket"),
    dict(match=r"^check_indices_kernel<.*, true>", hot=False, min_waves=1,
         reason="the benchmark's per-thread-atomic ablation, not a product path"),
    dict(match=r"^record_fatal_kernel\b", min_waves=1, max_atomics=1,
         reason="one thread: the call's report to the device error record (one compare-and-swap)"),
    dict(match=r"^check_b_offsets_kernel\b", min_waves=1, max_atomics=1,
         reason="one thread per VBE call: B_offsets' T + 1 values checked and bounded, the first failure to "
                "the device error record (one compare-and-swap, error path); no throughput to hide"),
    # -- grouped index select --
    dict(match=r"^fill_kernel\b", min_waves=4, no_atomics=True, reason="16-byte zero stores by wave tasks"),
    dict(match=r"^scatter_kernel<\w+, 2>", min_waves=2, cache=True,
         reason="two cache slots of fp32 partials per lane plus kUnroll rows in flight: registers traded "
                "for merged atomics; 2 waves per SIMD at the widest (fp64) vectors"),
    dict(match=r"^scatter_kernel<\w+, [01]>", hot=False, min_waves=1,
         reason="cache_slots 0 and 1: the ablation against FBGEMM's one slot"),
    dict(match=r"^gather_kernel<", min_waves=2, max_atomics=4, max_loop_atomics=1,
         reason="the forward row copy keeps kUnroll rows in flight per lane; its validation prologue adds one "
                "compare-and-swap per wave that holds a bad index (the device error record; error path)"),
    dict(match=r"^validate_kernel\b", min_waves=4, max_atomics=4, max_loop_atomics=1,
         reason="index validation: one compare-and-swap per wave holding a bad index (error path)"),
    dict(match=r"^keys_kernel\b", min_waves=4, no_atomics=True, reason="deterministic backward: sort keys"),
    dict(match=r"^segment_kernel<", min_waves=3, no_atomics=True,
         reason="deterministic backward: a wave sums each segment's rows with loads in flight, no atomics"),
    # -- TBE --
    dict(match=r"^tbe_pooled_kernel<", min_waves=2, no_atomics=True,
         reason="U rows x K vectors in flight per lane (about 8 16-byte loads, rows_in_flight in "
                "tbe_forward_impl.cuh) trade waves for memory parallelism within the wave"),
    dict(match=r"^tbe_sequence_kernel<", min_waves=2, no_atomics=True, reason="as the pooled lookup"),
    dict(match=r"^vbe_scan_kernel\b", min_waves=1, max_atomics=3,
         reason="VBE bag plan: one block scans the batch sizes once per call (a few microseconds); one "
                "compare-and-swap per check that fails (the device error record; error path)"),
    dict(match=r"^vbe_place_kernel\b", min_waves=4, no_atomics=True,
         reason="VBE bag plan: a binary search per bag over the blocks' first bags"),
    dict(match=r"^linearize_kernel<", min_waves=4, no_atomics=True, reason="backward stage 1: W-ary search"),
    dict(match=r"^psw_grad_kernel<", min_waves=4, no_atomics=True,
         reason="backward stage 2: dot products, two lookups' rows in flight"),
    dict(match=r"^(flag|starts)_kernel\b", min_waves=4, no_atomics=True, reason="segment flags and starts"),
    dict(match=r"^hot_pieces_kernel<", min_waves=4, no_atomics=True,
         reason="hot rows: each piece's partial sum to its own slot, no atomics"),
    dict(match=r"^step_kernel\b", hot=False, min_waves=1, no_atomics=True,
         reason="one thread advances the device-side step counter and writes the step's scalars once per "
                "backward: no throughput to hide"),
    dict(match=r"^apply_kernel<", row=r"^(apply_kernel)<(\w+)", min_waves=2, no_atomics=True,
         reason="the apply stage sorts and segments instead of atomics; a wave per segment with the "
                "gradient rows of U lookups in flight"),
]

ATOMIC = re.compile(r"^(global|flat|buffer)_atomic")
MFMA = re.compile(r"^v_mfma")
PERMUTE = re.compile(r"^(ds_bpermute_b32|ds_permute_b32|ds_swizzle_b32|v_permlane\w*)$")
DPP = re.compile(r"\b(quad_perm|row_shl|row_shr|row_ror|row_mirror|row_half_mirror|row_bcast|row_share|"
                 r"row_xmask|row_newbcast|wave_shl|wave_rol|wave_shr|wave_ror)\b|_dpp\b")
LOOP = re.compile(r"Depth=(\d+)")


class Kernel:
    def __init__(self, symbol):
        self.symbol = symbol
        self.meta = {}
        self.accum_offset = None
        self.atomics = []   # (opcode, loop depth)
        self.mfma = []      # (opcode, loop depth)
        self.dpp = 0
        self.permute = collections.Counter()


def parse_asm(path):
    """Kernels of one .s: metadata from the amdhsa.kernels YAML (and accum_offset from the .amdhsa_kernel
    block), instructions from the body between the kernel's label and its .Lfunc_end label."""
    kernels, functions, entries = {}, set(), []
    current, depth, after_label, descriptor, entry, in_meta = None, 0, False, None, None, False
    with open(path) as f:
        for line in f:
            if in_meta:
                if line.strip() == ".end_amdgpu_metadata" or line.startswith("amdhsa.target") or line.startswith("amdhsa.version"):
                    in_meta = False
                elif line.startswith("  - ."):
                    entry = {}
                    entries.append(entry)
                m = re.match(r"^  (?:- |  )\.(\w+):\s*(.*)$", line)
                if m and entry is not None:
                    entry[m.group(1)] = m.group(2).strip()
                continue
            # (clang places the kernel descriptor before or after the .Lfunc_end label, by version)
            m = re.match(r"^\s*\.amdhsa_kernel\s+(\S+)", line)
            if m:
                descriptor = m.group(1)
                continue
            m = re.match(r"^\s*\.amdhsa_accum_offset\s+(\d+)", line)
            if m and descriptor:
                kernels.setdefault(descriptor, Kernel(descriptor)).accum_offset = int(m.group(1))
                continue
            if current is not None:
                if line.startswith(".Lfunc_end"):
                    current = None
                    continue
                stripped = line.strip()
                if not stripped:
                    continue
                # A basic-block label (or "; %bb.N:" of a fall-through block) carries LLVM's loop comments,
                # continued on comment-only lines for nested loops: "Parent Loop .. Depth=1", then
                # "This Inner Loop Header: Depth=2" or "in Loop: Header=.. Depth=2". Its depth is the deepest.
                if not line[0].isspace():
                    m = LOOP.search(line)
                    depth, after_label = (int(m.group(1)) if m else 0), True
                    continue
                if stripped[0] == ";":
                    m = LOOP.search(stripped)
                    if after_label and m:
                        depth = max(depth, int(m.group(1)))
                    continue
                after_label = False
                if stripped[0] == ".":
                    continue
                op = stripped.split(None, 1)[0]
                k = kernels[current]
                if ATOMIC.match(op):
                    k.atomics.append((op, depth))
                elif MFMA.match(op):
                    k.mfma.append((op, depth))
                if PERMUTE.match(op):
                    k.permute[op] += 1
                if DPP.search(stripped.split(";", 1)[0]):
                    k.dpp += 1
                continue
            if line.startswith("amdhsa.kernels:"):
                in_meta = True
                continue
            m = re.match(r"^\s*\.type\s+([^,\s]+),@function", line)
            if m:
                functions.add(m.group(1))
                continue
            m = re.match(r"^([^\s:;]+):", line)
            if m and m.group(1) in functions:
                current, depth = m.group(1), 0
                kernels.setdefault(current, Kernel(current))
                continue
    if in_meta:
        raise SystemExit(f"amd_isa: {path}: unterminated amdhsa.kernels metadata")
    found = {}
    for e in entries:
        k = kernels.setdefault(e["name"], Kernel(e["name"]))
        k.meta = e
        found[e["name"]] = k
    return found


def demangle(symbols):
    tool = shutil.which("llvm-cxxfilt-22") or shutil.which("llvm-cxxfilt") or shutil.which("c++filt")
    if not tool or not symbols:
        return {s: s for s in symbols}
    out = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True, check=True).stdout
    return dict(zip(symbols, out.splitlines()))


TYPE_NAMES = [("hipdlrm::gpu::bfloat16_t", "bf16"), ("hipdlrm::gpu::half_t", "f16"), ("unsigned long", "u64"),
              ("unsigned int", "u32"), ("long", "i64"), ("int", "i32"), ("float", "f32"), ("double", "f64")]


def short_name(demangled):
    """`void ns::(anonymous namespace)::k<T, 4>(args)` -> `k<bf16, 4>`: no namespaces, no parameters,
    element types spelled as in PyTorch's dtype names."""
    s = demangled
    if s.startswith("void "):
        s = s[5:]
    depth, cut = 0, len(s)  # drop the parameter list: the last top-level parenthesis
    for i, c in enumerate(s):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and not s[i:].startswith("(anonymous"):
            cut = i
    s = s[:cut]
    s = s.replace("(anonymous namespace)::", "")
    s = re.sub(r"\b(hipdlrm::kernels::\w+::|hipdlrm::gpu::(?!\w+_t\b))", "", s)
    for long_name, short in TYPE_NAMES:
        s = re.sub(r"(?<![\w:])" + re.escape(long_name) + r"(?![\w])", short, s)
    s = re.sub(r"\bhipdlrm::\w+::", "", s)
    s = re.sub(r"\(\w+\)(\d+)", r"\1", s)  # enum casts: (Activation)2 -> 2
    return s


def lds_probe(path):
    """(kernel family, element bytes, head dim) -> dynamic LDS bytes, from the probe's data table."""
    table = {}
    if not os.path.exists(path):
        return table
    values, on = [], False
    with open(path) as f:
        for line in f:
            if re.match(r"^hipdlrm_dynamic_lds:", line):
                on = True
                continue
            if on:
                m = re.match(r"^\s*\.long\s+(-?\d+)", line)
                if m:
                    values.append(int(m.group(1)))
                elif line.strip() and not line.strip().startswith(";"):
                    break
    for i in range(0, len(values) - 3, 4):
        family = {0: "attention_forward_kernel", 1: "attention_backward_kernel"}[values[i]]
        table[(family, values[i + 1], values[i + 2])] = values[i + 3]
    return table


def element_type(short):
    m = re.match(r"^\w+<(\w+)", short)
    return m.group(1) if m else ""


class Row:
    """One kernel on one target, with what the ISA shows."""

    def __init__(self, target, source, k, short, dynamic_lds):
        t = TARGETS[target]
        md = k.meta
        self.target, self.source, self.short = target, source, short
        self.vgpr = int(md.get("vgpr_count", 0))
        self.agpr = int(md.get("agpr_count", 0))
        self.sgpr = int(md.get("sgpr_count", 0))
        self.static_lds = int(md.get("group_segment_fixed_size", 0))
        self.lds = self.static_lds + dynamic_lds
        self.scratch = int(md.get("private_segment_fixed_size", 0))
        self.vgpr_spills = int(md.get("vgpr_spill_count", 0))
        self.sgpr_spills = int(md.get("sgpr_spill_count", 0))
        self.dynamic_stack = md.get("uses_dynamic_stack", "false") == "true"
        self.wave = int(md.get("wavefront_size", 0))
        self.wg = int(md.get("max_flat_workgroup_size", 1024))
        self.atomics, self.mfma, self.dpp, self.permute = k.atomics, k.mfma, k.dpp, k.permute
        # Registers per lane: VGPRs, then AGPRs from accum_offset (a multiple of 4) when there are any.
        regs = self.vgpr
        if self.agpr > 0:
            regs = (k.accum_offset if k.accum_offset else 4 * math.ceil(self.vgpr / 4)) + self.agpr
        self.regs = t["granule"] * math.ceil(max(regs, 1) / t["granule"])
        waves_regs = min(t["max_waves"], t["regs"] // self.regs)
        # SGPRs (gfx9): more than 100 per wave leave room for 7 waves.
        waves_sgpr = 7 if self.sgpr > 100 else t["max_waves"]
        # LDS: whole workgroups per CU; their waves spread over the 4 SIMDs.
        wg_waves = math.ceil(self.wg / 64)
        if self.lds > t["lds_per_cu"]:
            waves_lds = 0
        elif self.lds == 0:
            waves_lds = t["max_waves"]
        else:
            groups = t["lds_per_cu"] // self.lds
            waves_lds = min(t["max_waves"], max(1, groups * wg_waves // SIMDS_PER_CU))
        self.waves = min(waves_regs, waves_sgpr, waves_lds)

    def mfma_shapes(self):
        return sorted(set(op[len("v_mfma_"):] for op, _ in self.mfma))


def check(row, e):
    """Failures of one kernel against its expectation entry: a list of messages."""
    fail = []
    lim = TARGETS[row.target]["lds_per_cu"]
    if row.wave != 64:
        fail.append(f"wavefront size {row.wave}, expected 64 (CDNA is wave64; the kernels' lane masks and "
                    "shuffles assume it)")
    if row.lds > lim:
        fail.append(f"LDS {row.lds} bytes per workgroup, over the {lim // 1024} KB of a {row.target} CU")
    if e.get("hot", True):
        if row.scratch or row.vgpr_spills or row.dynamic_stack:
            fail.append(f"scratch {row.scratch} bytes, {row.vgpr_spills} VGPRs spilled to memory"
                        f"{', dynamic stack' if row.dynamic_stack else ''}: a hot kernel must stay in registers")
    floor = e["min_waves"][row.target] if isinstance(e["min_waves"], dict) else e["min_waves"]
    if row.waves < floor:
        fail.append(f"{row.waves} waves per SIMD ({row.regs} registers per lane, LDS {row.lds} bytes), "
                    f"below its floor of {floor}: {e['reason']}")
    if e.get("no_atomics") and row.atomics:
        fail.append(f"{len(row.atomics)} global atomic instruction(s) ({row.atomics[0][0]}), expected none")
    if "max_atomics" in e:
        in_loop = [a for a in row.atomics if a[1] > 0]
        if len(in_loop) > e.get("max_loop_atomics", 0):
            fail.append(f"{len(in_loop)} global atomic(s) inside a loop ({in_loop[0][0]} at loop depth "
                        f"{in_loop[0][1]}; {e.get('max_loop_atomics', 0)} allowed): one atomic per element "
                        "instead of a bounded number per workgroup")
        if len(row.atomics) > e["max_atomics"]:
            fail.append(f"{len(row.atomics)} global atomic instructions, more than the {e['max_atomics']} "
                        "of its per-block reduction")
    if e.get("cache"):
        fail.extend(check_cache(row))
    if "mfma" in e:
        t = "bf16" if element_type(row.short) == "bf16" else "f16"
        pattern = re.compile(e["mfma"].replace("{T}", t))
        wrong = [op for op, _ in row.mfma if not pattern.match(op)]
        if wrong:
            fail.append(f"MFMA {wrong[0]}, expected {pattern.pattern} (the documented 16x16x16 tile of mma.h)")
        if not any(d > 0 for _, d in row.mfma):
            fail.append(f"no MFMA inside a loop: the attention inner loop lost its matrix cores "
                        f"(expected {pattern.pattern})")
    return fail


def check_cache(row):
    """The grouped index select backward merges the updates of one row in registers and adds a slot's
    partial only when the slot is evicted (in the per-position loop) or flushed (after that loop, one loop
    out). Its atomics thus sit at two loop depths. Without the cache every update is an atomic in the
    per-position loop and nothing is flushed: a single depth. (A compare-and-swap atomic, bf16's, sits in
    its own retry loop: its site is one loop out from the instruction.)"""
    if not row.atomics:
        return ["no global atomics at all: the scatter lost its adds"]
    sites = collections.Counter(d - 1 if "cmpswap" in op else d for op, d in row.atomics)
    deepest = max(sites)
    if all(d == deepest for d in sites):
        return [f"all {len(row.atomics)} global atomics at one loop depth ({deepest}), none flushed after the "
                "per-position loop: the register cache is gone (one atomic per position)"]
    return []


def fmt_range(values):
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def table(rows_by_target):
    """One markdown table: a line per kernel row (instances of one template grouped by `row`) and target."""
    lines = ["| file | kernel | target | inst | VGPR | AGPR | SGPR | LDS B | scratch | spills V / S | waves/SIMD | "
             "atomics (in loops) | MFMA | DPP | permute |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = collections.OrderedDict()
    for target in TARGETS:
        for r in rows_by_target.get(target, []):
            groups.setdefault((r.source, r.label), {}).setdefault(target, []).append(r)
    for (source, label), per in groups.items():
        for target, rs in per.items():
            atomics = [len(r.atomics) for r in rs]
            in_loops = [sum(1 for a in r.atomics if a[1] > 0) for r in rs]
            shapes = sorted(set(s for r in rs for s in r.mfma_shapes()))
            perm = collections.Counter()
            for r in rs:
                perm.update(r.permute)
            lines.append(
                f"| {source} | `{label}` | {target} | {len(rs)} | {fmt_range([r.vgpr for r in rs])} | "
                f"{fmt_range([r.agpr for r in rs])} | {fmt_range([r.sgpr for r in rs])} | "
                f"{fmt_range([r.lds for r in rs])} | {fmt_range([r.scratch for r in rs])} | "
                f"{fmt_range([r.vgpr_spills for r in rs])} / {fmt_range([r.sgpr_spills for r in rs])} | "
                f"{fmt_range([r.waves for r in rs])} | "
                f"{fmt_range(atomics)} ({fmt_range(in_loops)}) | {', '.join(shapes) or '-'} | "
                f"{sum(r.dpp for r in rs) or '-'} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(perm.items())) or '-'} |")
    return lines


def floors():
    lines = ["| kernels | waves/SIMD floor | reason |", "|---|---|---|"]
    for e in EXPECT:
        w = e["min_waves"]
        w = ", ".join(f"{t}: {n}" for t, n in w.items()) if isinstance(w, dict) else str(w)
        lines.append(f"| `{e['match']}` | {w} | {e['reason']} |")
    return lines


BEGIN = "<!-- BEGIN generated by scripts/amd_isa.py -->"
END = "<!-- END generated by scripts/amd_isa.py -->"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--docs")
    ap.add_argument("--partial", action="store_true", help="only some kernel files were compiled")
    args = ap.parse_args()

    rows_by_target, failures = {}, []
    matched = {target: collections.Counter() for target in TARGETS}
    for target in TARGETS:
        tdir = os.path.join(args.dir, target)
        files = sorted(f for f in os.listdir(tdir) if f.endswith(".s") and f != "lds_probe.s")
        if not files:
            raise SystemExit(f"amd_isa: no .s files under {tdir}")
        dynamic = lds_probe(os.path.join(tdir, "lds_probe.s"))
        parsed = []
        for f in files:
            for sym, k in parse_asm(os.path.join(tdir, f)).items():
                parsed.append((f[:-2], sym, k))
        names = demangle([sym for _, sym, _ in parsed])
        rows = []
        for source, sym, k in parsed:
            short = short_name(names[sym])
            hits = [i for i, e in enumerate(EXPECT) if re.search(e["match"], short)]
            if len(hits) != 1:
                failures.append(f"{target} {short}: matches {len(hits)} expectation entries in "
                                "scripts/amd_isa.py (exactly one expected)")
                continue
            e = EXPECT[hits[0]]
            matched[target][hits[0]] += 1
            dyn = 0
            m = re.match(r"^(attention_(?:forward|backward)_kernel)<\w+, (\d+)", short)
            if m:
                key = (m.group(1), 2, int(m.group(2)))
                if key not in dynamic:
                    failures.append(f"{target} {short}: no dynamic LDS size from lds_probe.s for {key}")
                dyn = dynamic.get(key, 0)
            r = Row(target, source, k, short, dyn)
            rm = re.search(e["row"], short) if "row" in e else None
            r.label = " ".join(rm.groups()) if rm else re.match(r"^[\w:]+", short).group(0)
            rows.append(r)
            for msg in check(r, e):
                failures.append(f"{target} {short}: {msg}")
        rows_by_target[target] = rows
        for i, e in enumerate(EXPECT):
            if matched[target][i] == 0 and not args.partial:
                failures.append(f"{target}: expectation {e['match']!r} matches no kernel (renamed or removed?)")

    lines = table(rows_by_target)
    print("\n".join(lines))
    total = sum(len(v) for v in rows_by_target.values())
    md = [BEGIN, "", f"Per kernel, from the ISA of clang's device compile ({total} kernel instances; "
          "`inst` = template instances in the row, ranges over them; atomics = global atomic instructions "
          "in the body, in brackets those inside a loop; LDS includes the attention kernels' dynamic LDS).",
          ""] + lines + ["", "Occupancy floors asserted in CI (scripts/amd_isa.py, EXPECT):", ""] + floors() + ["", END]
    with open(os.path.join(args.dir, "amd_isa.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    if args.docs:
        text = open(args.docs).read()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"amd_isa: {args.docs} has no generated section ({BEGIN} ... {END})")
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        with open(args.docs, "w") as f:
            f.write(head + "\n".join(md) + tail)
    if failures:
        for msg in failures:
            print(f"amd_isa: FAIL {msg}", file=sys.stderr)
        print(f"amd_isa: {len(failures)} expectation(s) failed", file=sys.stderr)
        return 1
    print(f"amd_isa: {total} kernel instances on {', '.join(TARGETS)}: every expectation holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
