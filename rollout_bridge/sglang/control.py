"""Health, identity and control of one or several SGLang servers (no generation, no weights).

`SGLangControl` is one part of the SGLang client (it holds the transport, `SGLangHTTP`; the
engine and the weight sync hold the same transport and this control part). What it does, per
server (docs/engines.md, SGLang, for the file:line citations):
  * `check_server`: GET /health (200 = a real one-token generation went through; 503 = starting,
    shutting down or unhealthy), GET /model_info (`model_path`, `weight_version`). SGLang reports
    no vocabulary size anywhere (/model_info, /server_info), so the vocabulary is checked against
    the served checkpoint's config.json when `model_path` is a directory this process can read,
    and is otherwise logged as unchecked. Every server must report the same weight version.
  * `weight_version`: GET /model_info -> "weight_version". (`/get_weight_version` does not exist in
    sglang 0.5.21+: 404.)
  * `server_layout`: GET /server_info -> tp_size / dp_size / pp_size (the weight-update group needs
    one rank per TP rank; SGLang refuses dp_size > 1 for it). The answer also holds the server's
    own API key (`resolved_dict()` of its arguments), so nothing but these three numbers is kept.
  * pause / continue, the weight-update session (begin/end), cache flush, memory release/resume,
    all sent to every server concurrently.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from rollout_bridge.sglang.http import SGLangHTTP, SGLangServerError
from rollout_bridge.core.types import EngineMismatchError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangControl:
    """Control plane of the SGLang servers (see module docstring).

    Args:
        http: The transport (server list, API key, control requests).
        vocab_size: Expected vocabulary (checked against the served config.json when readable).
        expected_model_path: `check_server` refuses servers serving another model_path.
        pause_mode: /pause_generation mode. "abort" (default): in-flight requests end with
            finish_reason abort and the client re-sends them after the update. "retract" /
            "in_place" keep them queued, which makes SGLang's post-update cache flush fail
            (scheduler_components/weight_updater.py:120-133), so the client then never asks for
            a flush.

    Attributes:
        known_version: The weight version last seen on (or pushed to) every server.
        model_info: The first server's /model_info from the last `check_server`.
    """

    def __init__(self, http: SGLangHTTP, *, vocab_size: int | None = None,
                 expected_model_path: str | None = None, pause_mode: str = "abort"):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.http = http
        self.vocab_size = vocab_size
        self.expected_model_path = expected_model_path
        self.pause_mode = pause_mode
        self.known_version: str | None = None
        self.model_info: dict | None = None

    # ------------------------------------------------------------------ identity and health

    def check_server(self) -> dict:
        """Startup checks on every server (module docstring).

        Returns:
            The first server's /model_info, with "weight_version" and "num_servers".

        Raises:
            EngineMismatchError: unhealthy or unreachable server, 401, another model, another
                vocabulary, or servers reporting different weight versions.
        """
        try:
            self.http.control_all("health")
            infos = self.http.control_all("model_info")
        except SGLangServerError as exc:
            raise EngineMismatchError(f"SGLang server check failed: {exc}") from exc
        versions = []
        for url, info in zip(self.http.base_urls, infos):
            if not isinstance(info, dict):
                raise EngineMismatchError(f"{url}: /model_info answered {str(info)[:200]}")
            if self.expected_model_path is not None and \
                    info.get("model_path") != self.expected_model_path:
                raise EngineMismatchError(f"{url} serves model {info.get('model_path')!r}, "
                                          f"expected {self.expected_model_path!r}")
            self._check_vocab(url, info.get("model_path"))
            versions.append(None if info.get("weight_version") is None
                            else str(info["weight_version"]))
        if len(set(versions)) != 1:
            raise EngineMismatchError("SGLang servers report different weight versions: "
                                      + ", ".join(f"{u}={v!r}" for u, v in
                                                  zip(self.http.base_urls, versions)))
        self.known_version = versions[0]
        info = dict(infos[0], weight_version=versions[0], num_servers=len(self.http.base_urls))
        self.model_info = info
        logger.info("SGLang: %d server(s) ok (%s), model %s, weight_version %s, API key %s",
                    len(self.http.base_urls), ", ".join(self.http.base_urls),
                    info.get("model_path"),
                    versions[0], "sent" if self.http.has_api_key else "not set")
        return info

    def _check_vocab(self, url: str, model_path: str | None) -> None:
        if self.vocab_size is None:
            return
        config = os.path.join(model_path or "", "config.json")
        if not (model_path and os.path.isfile(config)):
            logger.info("%s: vocabulary not checked (SGLang reports no vocab_size and %r is "
                        "not readable here)", url, model_path)
            return
        with open(config) as f:
            served = json.load(f).get("vocab_size")
        if served is not None and int(served) != int(self.vocab_size):
            raise EngineMismatchError(f"{url} serves {model_path} with vocab_size {served}, "
                                      f"expected {self.vocab_size}")

    def weight_versions(self) -> list[str | None]:
        """Every server's current weight version (GET /model_info), in server order."""
        infos = self.http.control_all("model_info")
        return [None if not isinstance(i, dict) or i.get("weight_version") is None
                else str(i["weight_version"]) for i in infos]

    def weight_version(self) -> str | None:
        """The servers' weight version (raises `EngineMismatchError` if they disagree)."""
        versions = self.weight_versions()
        if len(set(versions)) != 1:
            raise EngineMismatchError("SGLang servers report different weight versions: "
                                      + ", ".join(f"{u}={v!r}" for u, v in
                                                  zip(self.http.base_urls, versions)))
        self.known_version = versions[0]
        return versions[0]

    def server_layout(self) -> list[dict[str, int]]:
        """[{"tp_size", "dp_size", "pp_size"}] per server, from GET /server_info (only these
        three numbers are kept: the answer also holds the server's API key)."""
        out = []
        for url, info in zip(self.http.base_urls, self.http.control_all("server_info")):
            try:
                out.append({k: int(info[k]) for k in ("tp_size", "dp_size", "pp_size")})
            except (KeyError, TypeError, ValueError):
                raise EngineMismatchError(f"{url}: /server_info lacks tp_size/dp_size/pp_size") \
                    from None
            del info
        return out

    # ------------------------------------------------------------------ control

    def pause_generation(self, mode: str | None = None) -> list[Any]:
        """POST /pause_generation on every server (aborted in-flight items are retried later)."""
        return self.http.control_all("pause_generation", {"mode": mode or self.pause_mode})

    def continue_generation(self) -> list[Any]:
        """POST /continue_generation on every server."""
        return self.http.control_all("continue_generation", {})

    def begin_weight_update(self, selector: str = "all") -> None:
        """POST /begin_weight_update: opens the session update_weights_from_distributed/_tensor
        need (scheduler_components/weight_updater.py:187-199, :309)."""
        self.http.checked_all("begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> None:
        """POST /end_weight_update: closes the session (finalises quantised weights). The body
        is empty: EndWeightUpdateReqInput has no fields (io_struct.py:2208 (0.5.23))."""
        self.http.checked_all("end_weight_update", {})

    def flush_cache(self) -> None:
        self.http.control_all("flush_cache", None)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """POST /release_memory_occupation (colocated GPU mode; the server must be idle)."""
        self.http.control_all("release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.http.control_all("resume_memory_occupation", {"tags": tags})
