"""Models by Hugging Face Hub id: `ORG/NAME` (a safetensors folder) or `ORG/NAME:QUANT` (one GGUF file of
the repository), downloaded through `huggingface_hub` into its cache and served from there next time.

Only what the engine reads is downloaded: the config, tokenizer and chat-template files and the
safetensors weights (never other formats, READMEs or images). `huggingface_hub` honours `HF_HOME`,
`HF_HUB_OFFLINE`, `HF_ENDPOINT` and `HF_TOKEN`. A download whose connection breaks off resumes where it
stopped (a byte range); a file appears in the cache only once it is whole, so a run that fails leaves no
half-written model behind.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?\Z")
FOLDER_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                "chat_template.json", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json"]


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` has the shape of a Hub id (`ORG/NAME`, optionally `:QUANT`), not of a local path."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~"))


@functools.lru_cache(maxsize=16)
def download_model(name: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
                   gguf_file: Optional[str] = None) -> str:
    """The local path of Hub model `name` at `revision` (a branch, tag or commit; default main): the
    snapshot folder, or the GGUF file that `:QUANT` or `gguf_file` picks. Downloads what the cache lacks
    (into `download_dir` instead of the cache when given). ValueError names what went wrong."""
    from huggingface_hub import constants, hf_hub_download, list_repo_files, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, _, quant = name.partition(":")
    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        if quant or gguf_file:
            filename = gguf_file or _pick_gguf(list_repo_files(repo_id, revision=revision), repo_id, quant)
            path = hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir)
        else:
            path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=FOLDER_FILES)
    except GatedRepoError:
        raise ValueError(f"model {repo_id!r} is gated on the Hub: accept its terms on its page, then give a token "
                         f"that may read it (HF_TOKEN, or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id!r} was not found on the Hub ({constants.ENDPOINT}); if it is private, "
                         f"give a token that may read it (HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r} on the Hub") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        offline = " and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else ""
        raise ValueError(f"model {where} is not in the local cache{offline}, and the Hub could not be "
                         f"reached: {str(exc).splitlines()[0]}") from None
    except ValueError:
        raise
    except Exception as exc:  # the network's and the HTTP client's errors: the download is unfinished
        raise ValueError(f"model {where} could not be downloaded ({type(exc).__name__}: {exc}); nothing "
                         f"half-written was kept: run again to retry") from None
    commit = _commit_of(Path(path))
    logger.info("model %s%s is commit %s (%s)", repo_id, f" revision {revision}" if revision else "", commit, path)
    return path


def _pick_gguf(files: list[str], repo_id: str, quant: str) -> str:
    """The one .gguf file of the repository whose name carries `quant` (case-insensitive), or ValueError
    listing the ones there are."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if not quant:
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"model {repo_id!r} has {len(ggufs)} GGUF files; name one with {repo_id}:QUANT or "
                         f"--gguf-file: {sorted(ggufs)}")
    tag = re.compile(rf"(^|[^a-z0-9]){re.escape(quant.lower())}([^a-z0-9]|$)")
    matches = [f for f in ggufs if tag.search(Path(f).name.lower()[:-len(".gguf")])]
    if len(matches) != 1:
        found = "no GGUF file" if not matches else f"{len(matches)} GGUF files"
        raise ValueError(f"model {repo_id!r} has {found} for {quant!r}; its GGUF files: {sorted(ggufs) or 'none'}")
    return matches[0]


def _commit_of(path: Path) -> str:
    """The commit a path of the cache lies under (.../snapshots/<commit>/...), or 'unknown'."""
    parts = path.parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else "unknown"
