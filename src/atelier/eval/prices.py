"""The price table: dollars per million tokens in and out, per model.

The default table is `prices.toml` next to this module (edit it, or pass
another file with `--prices`). Keys are model names or shell patterns; the
longest matching key wins, then "default". A model that matches nothing has
no price and its cost is reported as unknown, never as 0.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from pydantic import Field

from atelier.config import AtelierConfig, ConfigError, load_config
from atelier.eval.records import EvalError

DEFAULT_PRICES = Path(__file__).with_name("prices.toml")


class Price(AtelierConfig):
    input: float = Field(ge=0)
    """Dollars per million prompt tokens."""
    output: float = Field(ge=0)
    """Dollars per million sampled tokens."""


class PriceTable(AtelierConfig):
    models: dict[str, Price] = Field(default_factory=dict)

    def lookup(self, model: str) -> Price | None:
        if model in self.models:
            return self.models[model]
        matches = [key for key in self.models if key != "default" and fnmatch.fnmatchcase(model, key)]
        if matches:
            return self.models[max(matches, key=len)]
        return self.models.get("default")

    def cost(self, model: str, tokens_in: int, tokens_out: int) -> float | None:
        price = self.lookup(model)
        if price is None:
            return None
        return (tokens_in * price.input + tokens_out * price.output) / 1e6


def load_prices(path: str | Path | None = None) -> PriceTable:
    """The table at `path` (default: the packaged `prices.toml`)."""
    path = Path(path) if path is not None else DEFAULT_PRICES
    if not path.is_file():
        raise EvalError(f"price table not found: {path}",
                        hint="pass a TOML file with [models.\"NAME\"] input = ... output = ... "
                             "(dollars per million tokens), or leave out --prices")
    try:
        return load_config(PriceTable, path)
    except ConfigError as exc:
        raise EvalError(f"price table {path}: {exc.message}", hint=exc.hint) from None
