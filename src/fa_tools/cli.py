"""fa-tools: one command line for the kernel toolchain.

  resources   registers, spills, stack, smem, barriers, compile time and occupancy per kernel
  sass        list kernels per arch; dump SASS, its control-flow graph (DOT) or the PTX
  count       opcode histograms: full and base opcodes, predicated, categories
  diff        compare two histograms or resource reports (files or two configs)
  ptx2sass    the SASS a PTX line became, and its backward register-dependence slice
  sanitize    compute-sanitizer memcheck/racecheck/synccheck/initcheck on small runs (GPU)
  debug       a config beside the block-by-block emulation: first mismatching row (GPU)
  bench       attention() against PyTorch SDPA FA2 and cuDNN (GPU)
  tools       which cuobjdump / nvdisasm the analyses use (path, version, origin)
  gate        static ratchet, sequential A/B perf gate and its power study (GPU), rebaseline,
              combined report

Kernels are named as flash_attention.kernels names them (fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor,
fwd_sm90_bf16_d128_r128_c128_s2_fwpia, bwd_sm80_bf16_d128_r64_c128_w8_fh,
bwd_sm90_bf16_d128_r64_c128_f, and the backward's helpers: bwd_sm80_preprocess_bf16 of both
kinds, the dQ conversions bwd_sm80_convert_dq_bf16 and bwd_sm90_convert_dq_bf16); a kernel
argument may also be a selection as FLASH_ATTENTION_KERNELS takes it (ci, default,
fwd_sm90:prog, bwd:default, ...: with the helpers of its backward kernels) or 'all' (everything
built). Hopper kernels (fwd_sm90_*, bwd_sm90_*) exist as sm_90a code alone: --arch 90 finds
them.
`resources` reads the one ptxas report of forward and backward.
Exit status: 0 ok, 1 errors found (sanitize, debug), 2 bad usage, 3 missing tool, binary or GPU.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import re
import sys
from pathlib import Path

from . import formats
from .analysis import cubins, diff, opcodes, ptx2sass, ptxas_report, sass
from .analysis.binaries import ToolError, extension_path, ptxas_log_path, tools_in_use
from .gate import cli as gate
from .gpu import bench

RESOURCE_COLUMNS = ["kernel", "arch", "registers", "spill_stores", "spill_loads", "stack_frame",
                    "static_smem", "dynamic_smem", "barriers", "cmem0", "compile_ms",
                    "ctas_per_sm", "warps_per_sm", "limited_by"]


def _binary(args: argparse.Namespace) -> Path:
    return Path(args.binary) if args.binary else extension_path()


def _kernels(binary: Path, names: list[str], arch: str | None = None) -> list[str]:
    """Kernel names of the given names / selections / 'all', as built in binary (a selection
    or 'all', everything built, keeps the kernels with code for `arch` where one is named: an
    sm_90a-only Hopper kernel under 90 or 90a, never under 80). A selection is what
    FLASH_ATTENTION_KERNELS takes (default, fwd_sm90:tune, bwd:default, ...): its kernels and
    the helpers of its backward and decode ones (helpers.helpers)."""
    from flash_attention.kernels import ConfigError, resolve
    from flash_attention.kernels.helpers import helpers

    built = sorted({m.kernel for m in cubins.list_cubins(binary)
                    if arch is None or m.arch == arch or (arch == "90" and m.arch == "90a")})
    out: list[str] = []
    for name in names:
        if name == "all":
            out += built
            continue
        try:
            configs = resolve(name)
        except ConfigError:
            out.append(name)  # a helper's name, or one the tools report as unknown
            continue
        out += [c.name for c in (*configs, *helpers(configs)) if c.name in built]
    return list(dict.fromkeys(out))


def cmd_resources(args: argparse.Namespace) -> int:
    records = ptxas_report.load(Path(args.log) if args.log else ptxas_log_path())
    rows = [r.as_dict() for r in records
            if fnmatch.fnmatch(r.kernel, args.kernel) and (not args.arch or r.arch == args.arch)]
    columns = RESOURCE_COLUMNS if args.format in ("table", "markdown", "csv") else None
    sys.stdout.write(formats.render(rows, args.format, columns))
    return 0


def cmd_sass(args: argparse.Namespace) -> int:
    binary = _binary(args)
    if args.action == "list":
        rows = [{"kernel": m.kernel, "arch": m.arch} for m in cubins.list_cubins(binary)]
        ptx = {(m.kernel, m.arch) for m in cubins.list_ptx(binary)}
        for row in rows:
            row["fatbin_ptx"] = "yes" if (row["kernel"], row["arch"]) in ptx else "no"
        sys.stdout.write(formats.render(rows, args.format))
        return 0
    if not args.kernel:
        raise SystemExit(f"fa-tools sass {args.action}: name a kernel (fa-tools sass list)")
    if args.action == "dump":
        text = sass.dump(binary, args.kernel, args.arch, strip_addresses=args.strip_addresses,
                         line_info=args.line_info, demangled=not args.mangled)
    elif args.action == "cfg":
        text = sass.cfg_dot(binary, args.kernel, args.arch, basic_blocks=not args.no_basic_blocks)
    else:
        text = sass.ptx_text(binary, args.kernel, args.arch)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def _histograms(binary: Path, kernels: list[str], arch: str) -> list[opcodes.Histogram]:
    return [opcodes.histogram(k, arch, sass.instructions(binary, k, arch, ptx_lines=False))
            for k in kernels]


def cmd_count(args: argparse.Namespace) -> int:
    binary = _binary(args)
    hists = _histograms(binary, _kernels(binary, args.kernels, args.arch), args.arch)
    if args.format in ("json", "yaml"):
        sys.stdout.write(formats.render([h.as_dict() for h in hists], args.format))
        return 0
    rows = []
    for h in hists:
        row = {"kernel": h.kernel, "arch": h.arch, "total": h.total, "predicated": h.predicated}
        row.update(h.categories)
        rows.append(row)
    sys.stdout.write(formats.render(rows, args.format))
    if args.opcodes != "none":
        for h in hists:
            table = h.full if args.opcodes == "full" else h.base
            sys.stdout.write(f"\n{h.kernel} sm_{h.arch} ({args.opcodes} opcodes)\n")
            sys.stdout.write(formats.render([{"opcode": k, "count": v} for k, v in table.items()],
                                            args.format))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    if args.configs:
        binary = _binary(args)
        a, b = args.configs
        if args.kind == "resources":
            records = ptxas_report.load(Path(args.log) if args.log else ptxas_log_path())
            docs = [[r.as_dict() for r in records if r.kernel == k and r.arch == args.arch]
                    for k in (a, b)]
        else:
            docs = [[h.as_dict() for h in _histograms(binary, [k], args.arch)] for k in (a, b)]
        labels = (a, b)
        before = diff.flatten(docs[0], with_kernel=False, opcodes=args.opcodes)
        after = diff.flatten(docs[1], with_kernel=False, opcodes=args.opcodes)
    else:
        if len(args.files) != 2:
            raise SystemExit("fa-tools diff: give two JSON reports, or --configs A B")
        docs = []
        for f in args.files:
            path = Path(f)
            if not path.is_file():
                raise SystemExit(f"fa-tools diff: {f} is not a file (two JSON reports from "
                                 "`fa-tools count/resources --format json`; to compare built "
                                 "configs use --configs A B)")
            try:
                docs.append(json.loads(path.read_text()))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"fa-tools diff: {f} is not a JSON report: {exc}") from None
        labels = tuple(Path(f).name for f in args.files)
        before = diff.flatten(docs[0], opcodes=args.opcodes)
        after = diff.flatten(docs[1], opcodes=args.opcodes)
    changes = diff.compare(before, after)
    sys.stdout.write(diff.markdown(changes, len(set(before) | set(after)), *labels))
    return 0


def cmd_ptx2sass(args: argparse.Namespace) -> int:
    binary = _binary(args)
    lines = sass.ptx_text(binary, args.kernel, args.arch).splitlines()
    if args.line is None:
        matches = ptx2sass.find_lines(lines, args.match)
        if not matches:
            raise SystemExit(f"fa-tools ptx2sass: no PTX line matches {args.match!r}")
        if args.nth >= len(matches):
            raise SystemExit(f"fa-tools ptx2sass: only {len(matches)} lines match")
        line_no = matches[args.nth]
    else:
        line_no = args.line
    instrs = sass.instructions(binary, args.kernel, args.arch)
    if all(i.ptx_line is None for i in instrs):
        raise ToolError(f"{args.kernel} sm_{args.arch} has no PTX line info (build with "
                        "-lineinfo, as setup.py does)")
    print(f"PTX line {line_no}: {lines[line_no - 1].strip()}")
    hits = ptx2sass.sass_for_line(instrs, line_no)
    print(f"\nSASS ({len(hits)} instructions):")
    for index, ins in hits:
        pred = f"{ins.predicate} " if ins.predicate else ""
        print(f"  [{index:5d}] {pred}{ins.opcode} {ins.operands}")
    print("\nbackward register slice (PTX):")
    for p in ptx2sass.backward_slice(lines, line_no, limit=args.limit):
        print(f"  {p.line:6d}: {p.text}")
    return 0


def cmd_sanitize(args: argparse.Namespace) -> int:
    from .gpu import sanitize

    binary = _binary(args)
    kernels = _kernels(binary, args.kernels)
    backward = [k for k in kernels if k.startswith("bwd_")]
    if backward:  # its runs are forward calls; ci/gpu_backward.sh sanitizes the backward
        print(f"left out {len(backward)} backward kernels (ci/gpu_backward.sh sanitizes them)")
        kernels = [k for k in kernels if not k.startswith("bwd_")]
    results = sanitize.run(kernels, tuple(args.tools.split(",")), timeout=args.timeout)
    rows = [{"tool": r.tool, "errors": r.errors if r.errors >= 0 else "unknown",
             "exit": r.returncode, "ok": "yes" if r.ok else "NO"} for r in results]
    print(f"compute-sanitizer on {len(kernels)} kernels, shapes {sanitize.SHAPES}")
    sys.stdout.write(formats.render(rows, "table"))
    for r in results:
        if not r.ok:
            print(f"\n--- {r.tool} log (last 40 lines) ---")
            print("\n".join(r.log.splitlines()[-40:]))
    return 0 if all(r.ok for r in results) else 1


def cmd_debug(args: argparse.Namespace) -> int:
    from .gpu import debug

    rows, mismatch = debug.run(args.kernel, args.batch, args.seqlen_q, args.seqlen_k, args.heads,
                               args.seed)
    if mismatch is None:
        print(f"{args.kernel}: no mismatch in {rows} rows (emulation of the same block order)")
        return 0
    m = mismatch
    print(f"{args.kernel}: first mismatch at batch {m.batch}, head {m.head}, query block "
          f"{m.q_block}, row {m.row}")
    print(f"  out[:8]      {[round(x, 4) for x in m.out]}")
    print(f"  expected[:8] {[round(x, 4) for x in m.expected]}")
    print(f"  lse {m.lse:.5f}, expected {m.expected_lse:.5f}")
    print("  emulation per KV block (block, m, l): "
          + ", ".join(f"({j}, {mm:.3f}, {ll:.3f})" for j, mm, ll in m.trace))
    return 1


_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def _sass_but_params(binary: Path, kernel: str, arch: str) -> list[tuple[str, str, str]]:
    """The kernel's SASS with every operand in the parameter bank (c[0x0][offset]) as one."""
    return [(i.predicate, i.opcode, _PARAM.sub("c[0x0][param]", i.operands))
            for i in sass.instructions(binary, kernel, arch, ptx_lines=False)]


def cmd_same_code(args: argparse.Namespace) -> int:
    """Whether two builds hold the same machine code, kernel for kernel under this tree's names
    (a build from before the one name scheme is named by its kernels' current names): the raw
    .text words of each kernel's cubin per GPU architecture (sm_90 runs the Hopper kernels'
    sm_90a code). With --but-params, a kernel whose words differ is compared again as SASS
    with its parameter-bank operands (c[0x0][offset]) taken as one: the same code reading its
    parameters at other offsets. Exit 0 when every kernel of both is the same (byte-identical,
    or but for its parameter offsets with --but-params), 1 otherwise."""
    from .gate.sassdiff import arch_of_kernel, changed_kernels, kernel_code

    base_bin, head_bin = Path(args.base).resolve(), Path(args.head).resolve()
    differ = 0
    for arch in args.archs.split(","):
        base = kernel_code(base_bin, arch)
        head = kernel_code(head_bin, arch)
        changes = changed_kernels(base, head)
        gone = sorted(set(base) - set(head))
        offsets = []
        if args.but_params:
            for c in changes:
                cubin_arch = arch_of_kernel(c.kernel, arch)
                if not c.new and (_sass_but_params(base_bin, c.kernel, cubin_arch)
                                  == _sass_but_params(head_bin, c.kernel, cubin_arch)):
                    offsets.append(c)
        same = len(head) - len(changes)
        print(f"sm_{arch}: {same} of {len(head)} kernels byte-identical"
              + (f", {len(offsets)} the same but for their parameter offsets" if offsets else "")
              + (f", {len(gone)} only in the base" if gone else ""))
        for c in changes:
            print(f"  {c.describe()}" + (": the same but for parameter offsets"
                                         if c in offsets else ""))
        for k in gone:
            print(f"  kernel {k}: only in the base")
        differ += len(changes) - len(offsets) + len(gone)
    return 1 if differ else 0


def cmd_tools(args: argparse.Namespace) -> int:
    """Which cuobjdump and nvdisasm the analyses use: path, version, origin."""
    used = tools_in_use()
    for name in ("cuobjdump", "nvdisasm"):
        t = used.get(name)
        print(f"{name}: {t['version']} ({t['origin']}: {t['path']})" if t else
              f"{name}: not found")
    return 0 if len(used) == 2 else 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fa-tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def binary_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--binary", help="extension .so to read (default: the installed one)")

    p = sub.add_parser("resources", help="ptxas resource report per kernel and arch")
    p.add_argument("--log", help="ptxas log (default: the one the build kept)")
    p.add_argument("--kernel", default="*", help="glob over kernel names")
    p.add_argument("--arch", help="only this arch, e.g. 90")
    p.add_argument("--format", choices=formats.FORMATS, default="table")
    p.set_defaults(func=cmd_resources)

    p = sub.add_parser("sass", help="list kernels, dump SASS / CFG / PTX")
    p.add_argument("action", choices=("list", "dump", "cfg", "ptx"))
    p.add_argument("kernel", nargs="?")
    p.add_argument("--arch", default="90")
    p.add_argument("--strip-addresses", action="store_true")
    p.add_argument("--line-info", action="store_true", help="annotate with PTX lines")
    p.add_argument("--mangled", action="store_true", help="keep mangled names")
    p.add_argument("--no-basic-blocks", action="store_true", help="CFG of branches only")
    p.add_argument("--format", choices=formats.FORMATS, default="table")
    binary_arg(p)
    p.set_defaults(func=cmd_sass)

    p = sub.add_parser("count", help="opcode histograms per kernel")
    p.add_argument("kernels", nargs="+", help="kernel names, selections (default, "
                   "fwd_sm90:prog, bwd:default, ...) or 'all'")
    p.add_argument("--arch", default="90")
    p.add_argument("--opcodes", choices=("none", "base", "full"), default="none")
    p.add_argument("--format", choices=formats.FORMATS, default="table")
    binary_arg(p)
    p.set_defaults(func=cmd_count)

    p = sub.add_parser("diff", help="compare two reports (markdown)")
    p.add_argument("files", nargs="*", help="two JSON reports from count or resources")
    p.add_argument("--configs", nargs=2, metavar=("A", "B"), help="compare two built configs")
    p.add_argument("--kind", choices=("count", "resources"), default="count")
    p.add_argument("--arch", default="90")
    p.add_argument("--opcodes", action="store_true", help="also compare every full opcode")
    p.add_argument("--log", help="ptxas log for --kind resources")
    binary_arg(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("same-code", help="are two builds' kernels byte-identical (by name)")
    p.add_argument("base", help="extension .so of the first build")
    p.add_argument("head", help="extension .so of the second build")
    p.add_argument("--archs", default="80,90", help="GPU architectures to compare")
    p.add_argument("--but-params", action="store_true",
                   help="kernels whose code differs only in parameter-bank offsets count as "
                        "the same")
    p.set_defaults(func=cmd_same_code)

    p = sub.add_parser("ptx2sass", help="SASS of a PTX line and its register slice")
    p.add_argument("kernel")
    p.add_argument("--arch", default="90")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--line", type=int, help="1-based PTX line number")
    group.add_argument("--match", help="regex; the nth matching PTX line")
    p.add_argument("--nth", type=int, default=0)
    p.add_argument("--limit", type=int, default=60, help="most slice instructions")
    binary_arg(p)
    p.set_defaults(func=cmd_ptx2sass)

    p = sub.add_parser("sanitize", help="compute-sanitizer on small runs (GPU)")
    p.add_argument("kernels", nargs="*", default=["default"])
    p.add_argument("--tools", default="memcheck,racecheck,synccheck,initcheck")
    p.add_argument("--timeout", type=int, default=600, help="seconds for all tools together")
    binary_arg(p)
    p.set_defaults(func=cmd_sanitize)

    p = sub.add_parser("debug", help="compare a config with the block emulation (GPU)")
    p.add_argument("kernel")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen-q", type=int, default=200)
    p.add_argument("--seqlen-k", type=int, default=300)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_debug)

    p = sub.add_parser("tools", help="which SASS tools the analyses use (path, version)")
    p.set_defaults(func=cmd_tools)

    bench.add_parser(sub)
    gate.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ToolError as exc:
        print(f"fa-tools {args.command}: {exc}", file=sys.stderr)
        return 3
    except BrokenPipeError:
        return 0
