"""`deepinfer make-tiny-model`: write a small deterministic checkpoint for tests and `serve`."""

from __future__ import annotations

from deepinfer.bin.cli import CliError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="write a tiny random checkpoint directory",
        description="Write a complete, deterministic tiny checkpoint (config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json with a chat template). Same seed, same bytes.",
    )
    p.add_argument("out", help="output directory (created if missing; files in it are overwritten)")
    p.add_argument("--arch", default="deepseek_v4", choices=["deepseek_v4", "deepseek_v41"],
                   help="model architecture (default deepseek_v4); deepseek_v41 writes the official V4.1 layout "
                   "with every layer role, FP8/FP4 storage, Engram, DSpark stages and a 2-layer vision tower")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    p.add_argument(
        "--layers",
        default=None,
        help="deepseek_v4: attention kind per layer: letters W (window only), C (CSA), H (HCA), or DeepSeek's "
        "compress ratios like 0,0,4,128 (default WWCHCHCH)",
    )
    p.add_argument("--hash-layers", type=int, default=None,
                   help="deepseek_v4: how many leading layers hash-route (default 2)")
    p.add_argument("--native", action="store_true",
                   help="deepseek_v4: write DeepSeek's native tensor names and config fields instead of transformers'")
    p.add_argument("--fp8", action="store_true",
                   help="deepseek_v4: store linears as FP8 E4M3 with 128x128 E8M0 block scales and experts as MXFP4")
    return p


def run(args) -> int:
    if args.arch == "deepseek_v41":
        return _run_v41(args)
    from deepinfer.engine.models.deepseek_v4.tiny_model import TinyModelError, write_tiny_model

    layers = "WWCHCHCH" if args.layers is None else args.layers
    num_hash = 2 if args.hash_layers is None else args.hash_layers
    try:
        cfg = write_tiny_model(
            args.out, seed=args.seed, layers=layers, num_hash_layers=num_hash,
            native=args.native, fp8=args.fp8,
        )
    except (TinyModelError, OSError) as exc:
        raise CliError(str(exc)) from None
    kinds = "".join({"sliding_attention": "W", "compressed_sparse_attention": "C",
                     "heavily_compressed_attention": "H"}[t] for t in cfg.layer_types)
    layout = ("native" if args.native else "transformers") + (" fp8/fp4" if args.fp8 else "")
    print(f"wrote {args.arch} tiny checkpoint to {args.out}: {cfg.num_hidden_layers} layers {kinds}, "
          f"{cfg.num_hash_layers} hash, vocab {cfg.vocab_size}, seed {args.seed}, {layout} layout")
    return 0


def _run_v41(args) -> int:
    given = [flag for flag, value in (("--layers", args.layers), ("--hash-layers", args.hash_layers),
                                      ("--native", args.native), ("--fp8", args.fp8)) if value not in (None, False)]
    if given:
        raise CliError(f"{given[0]} applies to --arch deepseek_v4; the deepseek_v41 tiny model has a fixed layout "
                       "(every layer role) in the official format with FP8/FP4 storage", code=2)
    from deepinfer.engine.models.deepseek_v41.tiny_model import write_tiny_v41

    try:
        cfg = write_tiny_v41(args.out, seed=args.seed)
    except OSError as exc:
        raise CliError(str(exc)) from None
    roles = " ".join(r.name for r in cfg.roles)
    print(f"wrote deepseek_v41 tiny checkpoint to {args.out}: {cfg.num_hidden_layers} layers ({roles}), "
          f"{cfg.num_stages} DSpark stages, Engram on layers {list(cfg.engram_layer_ids)}, "
          f"a {cfg.vision['num_hidden_layers']}-layer vision tower (image token {cfg.image_token_id}), "
          f"vocab {cfg.vocab_size}, seed {args.seed}, official layout fp8/fp4")
    return 0
