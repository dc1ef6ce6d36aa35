"""`colibri plan` on a terminal: one plan as Rich tables, or several machines side by side."""
from __future__ import annotations

from colibri.plan.policy import size_text

_STYLES = {"error": "bold red", "warning": "yellow"}


def _model_line(m: dict) -> str:
    return (f"model: dense {size_text(m['dense_bytes'])}, {m['expert_count']} experts in {m['moe_layers']} layers "
            f"({size_text(m['expert_size_bytes'])} each, {size_text(m['expert_bytes'])} in all), top-k {m['top_k']}, "
            f"{size_text(m['active_bytes_per_token'])} active per token")


def _slice_line(m: dict) -> str | None:
    if not m.get("slice_layers"):
        return None
    synthetic = m.get("synthetic") if isinstance(m.get("synthetic"), dict) else {}
    of = f" of {synthetic['preset']}" if synthetic.get("preset") else ""
    narrower = synthetic.get("width_divisor") or 1
    width = f" (every width 1/{narrower} of the real model's)" if isinstance(narrower, int) and narrower > 1 else ""
    return (f"[bold]projected[/bold] from a {m['slice_layers']}-layer slice{of}{width}: sizes, KV cache and speed "
            f"are for the full model's {m['layers']} layers")


def render_plan(plan: dict, console) -> None:
    """The plan as Rich tables."""
    from rich.table import Table

    m, t, pr = plan["model"], plan["tiers"], plan["projection"]
    mach = plan["machine"]
    console.print(f"[bold]colibri plan[/bold] v{plan['version']} for {m['dir']} ({m['model_type']}, {m['kind']})",
                  highlight=False)
    gpus = ", ".join(f"{g['name']} {size_text(g['free_bytes'])} free" for g in mach["gpus"]) or "no GPU"
    disk = f"{mach['disk_read_gbs']:.2f} GB/s" if mach.get("disk_read_gbs") else "not measured"
    # --mirror: the projection reads from every drive at once
    striped = f", striped over {pr['drives']} drives: {pr['disk_gbs']:.2f} GB/s" if pr.get("drives", 1) > 1 else ""
    console.print(f"machine: {mach['cores']} cores, {size_text(mach['ram_available_bytes'])} of "
                  f"{size_text(mach['ram_total_bytes'])} RAM available, {gpus}, disk {disk} "
                  f"({mach.get('disk_probe', '')}){striped}", highlight=False)
    console.print(_model_line(m), highlight=False)
    if note := _slice_line(m):
        console.print(note, highlight=False)
    table = Table(title=None)
    for col in ("tier", "limit", "planned", "dense", "experts", "expert bytes", "slots"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for tier, label in (("vram", "VRAM"), ("ram", "RAM")):
        row = t[tier]
        table.add_row(label, size_text(row["limit_bytes"]), size_text(row["budget_bytes"]),
                      size_text(row["dense_bytes"]), str(row["experts"]), size_text(row["expert_bytes"]),
                      str(row["slots_per_layer"]))
    table.add_row("disk", "-", size_text(t["disk"]["bytes"]), "-", f"{t['disk']['experts_disk_only']} only",
                  size_text(t["disk"]["expert_bytes"]), "-")
    console.print(table)
    console.print("[dim]slots: expert cache slots per MoE layer; every expert also stays on disk[/dim]")
    lo, hi = pr["tok_s"]
    hlo, hhi = pr["hit_rate"]
    console.print(f"bottleneck: [bold]{plan['bottleneck']}[/bold] ({plan['bottleneck_reason']})", highlight=False)
    if plan["fits"]:
        console.print(f"projected: {lo:.1f}-{hi:.1f} tok/s, expert hit rate {hlo:.0%}-{hhi:.0%}", highlight=False)
    for w in plan["warnings"]:
        style = _STYLES.get(w["level"], "dim")
        console.print(f"[{style}]{w['level']}:[/{style}] {w['message']}", highlight=False)


def _slots(tier: dict) -> str:
    return f"{tier['slots_per_layer']} ({size_text(tier['expert_bytes'])})" if tier["experts"] else "0"


def _column(plan: dict) -> dict[str, str]:
    """One machine's cells of the comparison, by row: the machine, its budgets, the projection."""
    mach, t, pr, kv = plan["machine"], plan["tiers"], plan["projection"], plan["kv_cache"]
    # the VRAM tier counts the KV cache with the dense weights it sits beside
    dense = t["vram"]["dense_bytes"] - kv["bytes"] if plan["dense_tier"] == "vram" else t["ram"]["dense_bytes"]
    (hlo, hhi), (lo, hi) = pr["hit_rate"], pr["tok_s"]
    return {
        "machine": f"{mach['cores']} cores, {size_text(mach['ram_total_bytes'])}",
        "GPUs": ", ".join(f"{g['name']} {size_text(g['total_bytes'])}" for g in mach["gpus"]) or "none",
        "disk read": f"{pr['disk_gbs']:.2f} GB/s" + (f" ({pr['drives']} drives)" if pr.get("drives", 1) > 1 else "")
                     + ("" if mach.get("disk_read_gbs") else " (assumed)"),
        "memory read": f"{pr['mem_gbs']:.0f} GB/s" + ("" if mach.get("mem_read_gbs") else " (assumed)"),
        "RAM limit": size_text(t["ram"]["limit_bytes"]),
        "dense weights": f"{size_text(dense)} in {plan['dense_tier'].upper()}",
        "KV cache": f"{size_text(kv['bytes'])} in {kv['tier'].upper()}"
                    + (f" (of which fixed state {size_text(kv['state_bytes'])})" if kv.get("state_bytes") else ""),
        "VRAM slots/layer": _slots(t["vram"]),
        "RAM slots/layer": _slots(t["ram"]),
        "experts on disk only": f"{t['disk']['experts_disk_only']} of {t['disk']['experts']}",
        "expert hit rate": f"{hlo:.0%}-{hhi:.0%}" if plan["fits"] else "-",
        "tok/s": f"[bold]{lo:.2f}-{hi:.2f}[/bold]" if plan["fits"] else "[bold red]dense part does not fit[/bold red]",
        "bound by": plan["bottleneck"],
    }


_SECTION_ENDS = ("memory read", "experts on disk only")  # the machine | its budgets | the projection


def render_comparison(plans: dict[str, dict], console) -> None:
    """Several machines' plans for one model, side by side (one column per machine)."""
    from rich.table import Table

    first = next(iter(plans.values()))
    m = first["model"]
    console.print(f"[bold]colibri plan[/bold] v{first['version']} for {m['dir']} ({m['model_type']}, {m['kind']}), "
                  f"{len(plans)} machines, {m['context']}-token context", highlight=False)
    console.print(_model_line(m), highlight=False)
    if note := _slice_line(m):
        console.print(note, highlight=False)
    table = Table(title=None)
    table.add_column("")
    for name in plans:
        table.add_column(name, justify="right")
    columns = [_column(plan) for plan in plans.values()]
    for label in columns[0]:
        table.add_row(label, *(cells[label] for cells in columns), end_section=label in _SECTION_ENDS)
    console.print(table)
    console.print("[dim]slots: expert cache slots per MoE layer (the bytes they hold); RAM limit: available "
                  "memory minus headroom[/dim]")
    for name, plan in plans.items():
        console.print(f"{name}: bound by [bold]{plan['bottleneck']}[/bold] ({plan['bottleneck_reason']})",
                      highlight=False)
    # A note that holds for several machines is printed once, naming them.
    notes: dict[tuple[str, str], list[str]] = {}
    for name, plan in plans.items():
        for w in plan["warnings"]:
            notes.setdefault((w["level"], w["message"]), []).append(name)
    for (level, message), names in notes.items():
        style = _STYLES.get(level, "dim")
        who = "" if len(names) == len(plans) else f" ({', '.join(names)})"
        console.print(f"[{style}]{level}{who}:[/{style}] {message}", highlight=False)
