"""Regenerate the fast-tokenizer files of src/diloco/assets/mistral-7b-v0.1/ from its tokenizer.model.

    .venv/bin/python scripts/build_tokenizer.py          # needs sentencepiece (a dev dependency)

tokenizer.model is Mistral-7B-v0.1's SentencePiece model (PROVENANCE.md says where it comes from). This
checks its SHA-256 and writes tokenizer.json in the layout of the Hub's mistralai/Mistral-7B-v0.1
tokenizer.json, the one OpenDiLoCo's transformers 4.x loaded: BPE with byte fallback, a normalizer that
prepends "▁" and turns spaces into "▁" (SentencePiece's dummy prefix and whitespace escaping), no
pre-tokenizer, <s> prepended. Merges are ranked by piece score as SentencePiece ranks them (the
whitespace-only pieces, "▁▁" and longer, score -1e9 and merge last). tokenizer_config.json and
special_tokens_map.json say what the Hub's say, except `tokenizer_class`: PreTrainedTokenizerFast, which
loads tokenizer.json as it is; transformers 5 rebuilds a LlamaTokenizer around a Metaspace pre-tokenizer
that drops the dummy prefix of a text starting with a space. `AutoTokenizer.from_pretrained(<dir>)` then
needs only `tokenizers`; tests/data/test_tokenizer.py checks it encodes exactly as SentencePiece does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "src" / "diloco" / "assets" / "mistral-7b-v0.1"
SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"  # the Hub's tokenizer.model

SPECIAL = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}  # ids 0, 1, 2
# mistralai/Mistral-7B-v0.1's tokenizer_config.json but for the class: <s> prepended, no </s> appended,
# no pad token (diloco.data.load_tokenizer pads with </s>), legacy spacing (a "▁" before every chunk of
# text, also right after a special token).
TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    **SPECIAL,
    "clean_up_tokenization_spaces": False,
    "legacy": True,
    "model_max_length": 1000000000000000019884624838656,
    "pad_token": None,
    "padding_side": "left",
    "spaces_between_special_tokens": False,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def convert(model_file: Path):
    """The `tokenizers.Tokenizer` equivalent of the SentencePiece BPE model in `model_file`."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    # Only normal pieces merge (not <unk>, <s>, </s> or the <0x..> byte pieces); SentencePiece applies
    # the best-scoring merge first, and ids break ties.
    normal = {
        sp.id_to_piece(i): (-sp.get_score(i), i) for i in range(sp.get_piece_size()) if is_normal(sp, i)
    }
    ranked = sorted(
        (rank, piece[:k], piece[k:])
        for piece, rank in normal.items()
        for k in range(1, len(piece))
        if piece[:k] in normal and piece[k:] in normal
    )
    bpe = models.BPE(
        vocab, [(a, b) for _, a, b in ranked], unk_token="<unk>", fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL.values()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def is_normal(sp, i: int) -> bool:
    return not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(asset: Path) -> None:
    model = asset / "tokenizer.model"
    if sha256(model) != SHA256:
        raise SystemExit(
            f"build_tokenizer: {model} is not Mistral-7B-v0.1's tokenizer.model (SHA-256 differs)"
        )
    convert(model).save(str(asset / "tokenizer.json"), pretty=False)  # one line, 1.4 MB (3.5 MB pretty)
    write_json(asset / "tokenizer_config.json", TOKENIZER_CONFIG)
    write_json(asset / "special_tokens_map.json", SPECIAL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=ASSET, help="the asset directory (default: %(default)s)")
    build(p.parse_args().dir)


if __name__ == "__main__":
    main()
