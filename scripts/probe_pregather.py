#!/usr/bin/env python3
"""The gathered-row GEMMs of the layer (gemm1, dh', dw13, dw2) as the layer runs them (rows gathered through
slot_token by the producers' cp.async) against the same GEMM on rows gathered beforehand into slot order (a separate
gather, then the kernel variant that loads A by TMA as the second GEMM and dx do), in one run.

Records one forward+backward of ``blazecore_torch.moe_ffn`` ("ab"), then for each of those launches replays
(a) the launch as recorded and (b) a row gather A_g = A[slot_token] followed by the launch with A_g in slot order,
``--reps`` times each with CUDA events, and compares the outputs of (a) and (b) bit for bit where the launch does
not rewrite its own input (every one but dh', which writes dz over z).

Usage: BLAZECORE_STAGE_ROWS=never PYTHONPATH=.:adapters python3 scripts/probe_pregather.py [--shapes olmoe,mixtral]
[--tokens 32768] (with the layer's own staging on, the launches that already read staged rows are not probed)
Prints a table and writes DIR/probe_pregather_<gpu>.json. Needs a Hopper GPU.
"""

from __future__ import annotations

import inspect
import statistics


def _launch_pregathered(G, kern, which, grid, stream, a_g, kw):
    """The recorded launch's GEMM with A replaced by its rows in slot order (a_g), A by TMA."""
    from blazecore import _compile, _moe_args, _tma

    v = kern.variants[which]
    kv = kern.variant(which)
    if which in ("gemm1", "dhcur"):
        name = G._gemm90_name(kern.ct, v.b_kmajor, v.epi, v.act, False, b_tma=True, a_tma=True)
        Kd = kw["Kd"]
        sig = inspect.signature(G._launch_m)  # the launcher's defaults for what the recorded call left out
        fields = {k: q.default for k, q in sig.parameters.items() if q.default is not inspect.Parameter.empty}
        fields.update(kw)
        disp = fields.pop("disp")
        fields.update(A=a_g, lda=Kd, slot_token=disp.slot_token, slot_k=disp.slot_k, offsets=disp.expert_offsets,
                      num_experts=fields.pop("E"))
        up = fields.get("up", 0)
        args = _moe_args.pack(_moe_args.M_GROUPED, **{k: fields.get(k) for k in _moe_args.M_GROUPED.names})
        bmap = G._b_map(kern, which, kw["B"], kw["ldb"], kw["b_estride"], kw["E"], kw["N"], Kd,
                        up if which == "gemm1" else 0)
        extra = (bmap, G._rows_map(kern, a_g, Kd, Kd, G.BM), _tma.null_map())
        grid = G._persistent_grid(grid)
    else:
        name = G._wgrad90_name(kern.ct, False, False, out_t=which == "dw13", a_tma=True, b_tma=True)
        disp = kw["disp"]
        args = _moe_args.pack(
            _moe_args.K_GROUPED, A=a_g, B=kw["B"], slot_token=disp.slot_token, offsets=disp.expert_offsets,
            kblocks=kw["kblocks"], out=kw["out"], carry=None, carry_seen=None, lda=kw["M"], ldb=kw["ldb"],
            ldo=kw["ldo"], o_estride=kw["o_estride"], num_experts=kw["E"], M=kw["M"], N=kw["N"],
            num_kblocks=kw["num_kblocks"], carry_in=False, carry_out=False, a_off32=0, b_off32=0)
        extra = (G._rows_map(kern, a_g, kw["M"], kw["M"], 64), G._rows_map(kern, kw["B"], kw["ldb"], kw["N"], 64))
    assert all(m is not None for m in extra), "a tensor map the probe needs"
    fn = _compile.get_function(kv.file, name, module_names=[name], max_dynamic_smem=kv.smem)
    fn((int(grid),), (kv.threads,), (args, *extra), shared_mem=kv.smem, stream=stream)


def _probe_one(G, cupy, timed, shape, L, reps, orig, kern, which, grid, st, kw) -> dict:
    """One recorded launch: (a) as recorded, (b) gather + the pre-gathered launch; medians of ``reps``."""
    disp = kw["disp"]
    width = kw["Kd"] if which in ("gemm1", "dhcur") else kw["M"]
    n_slots = int(disp.slot_token.shape[0])
    tok, A = disp.slot_token[:n_slots], kw["A"]
    outs = [kw["out"]] + ([kw["out2"]] if kw.get("out2") is not None else [])
    holder = {}

    def gather():
        holder["a_g"] = cupy.ascontiguousarray(A[tok, :width])

    t_orig, t_gather, t_pre, same = [], [], [], True
    for i in range(reps + 1):
        a = timed(lambda: orig(kern, which, grid, st, **kw))
        ref = [o.copy() for o in outs]
        g = timed(gather)
        p = timed(lambda: _launch_pregathered(G, kern, which, grid, st, holder["a_g"], kw))
        if i == 0:  # the first pass warms (and compiles); its outputs are compared
            same = which == "dhcur" or all(bool((o.view(cupy.uint16) == r.view(cupy.uint16)).all())
                                           for o, r in zip(outs, ref, strict=True))
        else:
            t_orig.append(a)
            t_gather.append(g)
            t_pre.append(p)
    row = {"shape": shape, "tokens": L, "gemm": which, "width": width, "n": kw["N"],
           "in_kernel_gather_ms": statistics.median(t_orig), "gather_ms": statistics.median(t_gather),
           "pregathered_gemm_ms": statistics.median(t_pre), "bits_equal": bool(same),
           "gather_bytes": 2 * n_slots * width * 2}
    row["pregathered_total_over_in_kernel"] = (row["gather_ms"] + row["pregathered_gemm_ms"]) / \
        row["in_kernel_gather_ms"]
    print(f"{shape:8s} {L:7d} {which:6s} N {kw['N']:6d} in-kernel {row['in_kernel_gather_ms']:8.3f} ms  "
          f"gather {row['gather_ms']:7.3f} + gemm {row['pregathered_gemm_ms']:8.3f} ms  "
          f"ratio {row['pregathered_total_over_in_kernel']:5.3f}  bits {same}", flush=True)
    return row


def measure(torch, ops, cupy, shape, L, reps) -> list:
    from probe_layer_gemms import layer_step, record_launches

    from blazecore import _moe_gpu as G

    step = layer_step(torch, ops, shape, L)
    step()
    torch.cuda.synchronize()
    launches, kept = record_launches(step)
    torch.cuda.synchronize()
    stream = cupy.cuda.get_current_stream()

    def timed(f):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        f()
        e1.record(stream)
        e1.synchronize()
        return cupy.cuda.get_elapsed_time(e0, e1)

    rows = []
    for orig, kern, which, grid, st, _a, kw in launches:
        if which in ("gemm1", "dhcur", "dw13", "dw2") and kw.get("carry") is None:
            rows.append(_probe_one(G, cupy, timed, shape, L, reps, orig, kern, which, grid, st, kw))
    del kept
    return rows


def main(argv=None) -> int:
    from probe_layer_gemms import probe_main

    return probe_main("probe_pregather", __doc__, measure, "olmoe,qwen3,fine,mixtral", argv)


if __name__ == "__main__":
    raise SystemExit(main())
