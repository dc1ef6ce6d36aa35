"""`colibri` command line (Typer). Every command builds one Engine (or calls the converter);
user mistakes (ColibriError) print one line and exit 1, never a traceback."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from colibri.errors import ColibriError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run Mixture-of-Experts language models bigger than memory.")
err = Console(stderr=True)

ModelOpt = typer.Option(None, "--model", "-m", help="Model container directory (default: embedded SmolLM2-135M-Instruct).")


@app.command()
def run(
    prompt: str = typer.Argument(..., help="The prompt (chat template applied unless --raw)."),
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as plain text, no chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context length in tokens "
                                              "(default: the model's, at most 8192)."),
    stats: bool = typer.Option(False, "--stats", help="Print speed figures to stderr at the end."),
):
    """Generate an answer to PROMPT, printed as it streams."""
    from colibri.engine import Engine

    if max_tokens < 0:
        raise ColibriError(f"--max-tokens must be >= 0, not {max_tokens}")
    engine = Engine.load(model, progress=True, max_context=max_context)
    for ev in engine.stream(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, raw=raw, system=system):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if stats and engine.last:
        g = engine.last
        err.print(f"[dim]{g.prompt_tokens} prompt tokens ({g.prefill_tok_s:.1f} tok/s), "
                  f"{g.completion_tokens} generated ({g.decode_tok_s:.1f} tok/s), "
                  f"TTFT {g.ttft_s * 1000:.0f} ms, load {engine.load_s:.2f} s, finish: {g.finish_reason}[/dim]")


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint directory or .gguf file."),
    dst: Path = typer.Argument(..., help="Output container directory (must not exist or be empty)."),
    bits: int = typer.Option(4, "--bits", help="4 (int4 g64, default), 8 (int8 g32) or 32 (float32, exact). "
                             "Ignored for GGUF, which is repacked losslessly."),
):
    """Convert a checkpoint into a colibri model container."""
    from colibri.io.convert import convert as do_convert

    out = do_convert(src, dst, bits=bits, progress=True)
    err.print(f"wrote {out}")


def main() -> None:
    try:
        app()
    except ColibriError as e:
        err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
