"""A reduced draft vocabulary: the block drafter scores only a fixed subset of token ids (the first K of a
frequency ranking of the target's own replies) through the target's head rows gathered once, and hands the
loop full-vocabulary logits with every other token at `OUTSIDE_LOGIT`. Verification still decides every
token, so outputs are unchanged; only τ can drop. Design notes: docs/design/models.md.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.models.config import ModelConfig

RANKING_FILE = "draft_vocab.npy"  # a drafter folder's token ranking, most frequent first
# Far below any real logit yet finite: softmax gives 0, log-softmax stays finite (tree path scores add
# them), and no 0 * inf appears where a consumer weighs log-probabilities.
OUTSIDE_LOGIT = -1e30


class DraftVocabError(ValueError):
    """A draft vocabulary size or token ranking that cannot be used."""


def check_ids(ids, vocab_size: int, field: str = "drafter.draft_vocab_ids") -> np.ndarray:
    """ids as int32 [K] after checking they are distinct token ids of the vocabulary (DraftVocabError
    naming `field` otherwise)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise DraftVocabError(f"{field}: a draft vocabulary is a non-empty 1-d list of integer token ids, "
                              f"got shape {ids.shape} of {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise DraftVocabError(f"{field}: token id {int(bad[0])} is outside the target's vocabulary "
                              f"[0, {vocab_size}); rebuild the ranking for this target")
    if np.unique(ids).size != ids.size:
        raise DraftVocabError(f"{field}: the token ids repeat; a ranking lists each id once")
    return ids.astype(np.int32)


def load_ranking(path, vocab_size: int, field: str = "drafter.draft_vocab_ids") -> np.ndarray:
    """The checked token ranking stored at `path` (a .npy of ids, most frequent first)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DraftVocabError(f"{field}: no token ranking at {path}; make one with "
                              f"`python experiments/draft_vocab.py` (docs/default-pair.md) or set "
                              f"drafter.draft_vocab=null")
    return check_ids(np.load(path, allow_pickle=False), vocab_size, field)


def select(ranking: np.ndarray, k: int, vocab_size: int, field: str = "drafter.draft_vocab") -> np.ndarray:
    """The first k ids of a ranking, sorted (DraftVocabError naming `field` for a k it cannot give)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 < k <= vocab_size:
        raise DraftVocabError(f"{field}: must be an integer in [1, {vocab_size}] (the target's vocabulary) "
                              f"or null for the full vocabulary, got {k!r}")
    if k > ranking.size:
        raise DraftVocabError(f"{field}: {k} tokens asked, the ranking holds {ranking.size}; ask for fewer "
                              f"or rebuild the ranking")
    return np.sort(ranking[:k])


def ranking_from_counts(counts, tiebreak=None) -> np.ndarray:
    """Every token id, most counted first; equal counts (unseen tokens too) by `tiebreak`'s counts, most
    first, then by id: [V] int32."""
    counts = np.asarray(counts, np.int64)
    tiebreak = np.zeros_like(counts) if tiebreak is None else np.asarray(tiebreak, np.int64)
    return np.lexsort((np.arange(counts.size), -tiebreak, -counts)).astype(np.int32)


def head_rows(target_params: dict, target_cfg: ModelConfig, ids: np.ndarray) -> jax.Array:
    """The target's output head restricted to `ids`, [K, H] in the head's dtype: the tied embedding's rows
    or the untied head's columns (read from the unencoded params)."""
    ids = jnp.asarray(ids, jnp.int32)
    if target_cfg.tie_word_embeddings:
        return jnp.take(target_params["embed"], ids, axis=0)
    return jnp.take(jnp.asarray(target_params["lm_head"]), ids, axis=1).T


def with_draft_vocab(drafter_params: dict, target_params: dict, target_cfg: ModelConfig, ids) -> dict:
    """Drafter params carrying the reduced head (`draft_head` [K, H], `draft_ids` [K] int32): gathered
    here, once, never per step."""
    ids = check_ids(ids, target_cfg.vocab_size)
    return {**drafter_params, "draft_head": head_rows(target_params, target_cfg, ids),
            "draft_ids": jnp.asarray(ids, jnp.int32)}


def has_draft_vocab(drafter_params) -> bool:
    return isinstance(drafter_params, dict) and "draft_head" in drafter_params


def reduced_logits(drafter_params: dict, hidden: jax.Array, vocab_size: int) -> jax.Array:
    """Final-normed hidden [..., H] -> float32 logits [..., V]: the subset's scores at their ids,
    `OUTSIDE_LOGIT` everywhere else."""
    head = drafter_params["draft_head"]
    scores = jnp.einsum("...h,kh->...k", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)
    full = jnp.full(hidden.shape[:-1] + (vocab_size,), OUTSIDE_LOGIT, jnp.float32)
    return full.at[..., drafter_params["draft_ids"]].set(scores, unique_indices=True)
