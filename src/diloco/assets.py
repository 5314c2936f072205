"""Files shipped inside the package (the bundled sample), and the `${diloco_asset:...}` config resolver.

Kept free of heavy imports so launch tooling can compose configs quickly.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def asset_path(relative: str) -> str:
    return str(ASSETS / relative)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("diloco_asset"):
        # ${diloco_asset:sample/tokenizer} -> absolute path inside the installed package
        OmegaConf.register_new_resolver("diloco_asset", asset_path)


register_resolvers()
