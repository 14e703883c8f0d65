"""Upload the dashboards to Grafana with grafana-client (the maintained successor of grafana-api).

One `POST /api/dashboards/db` per dashboard (`overwrite: true`, so pushing again updates in place), with
`Authorization: Bearer <token>` (a Grafana service-account token). With `folder`, the dashboards go
into the folder of that title, created (with a uid derived from the title) when it does not exist.
"""

from __future__ import annotations

import re
from typing import Any

from . import dashboards

MESSAGE = "kvtier dashboards push"


def folder_uid(title: str) -> str:
    """A stable Grafana folder uid for a folder title (Grafana uids: at most 40 of [A-Za-z0-9_-])."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", title.strip()).strip("-").lower()
    return (slug or "kvtier")[:40]


def _client(url: str, token: str, timeout: float):
    from grafana_client import GrafanaApi

    return GrafanaApi.from_url(url, credential=token, timeout=timeout)


def ensure_folder(api, title: str) -> str:
    """The uid of the folder titled `title`, creating it if needed."""
    for f in api.folder.get_all_folders() or []:
        if f.get("title") == title:
            return f["uid"]
    created = api.folder.create_folder(title, uid=folder_uid(title))
    return created["uid"]


def push(url: str, token: str, *, folder: str | None = None, timeout: float = 30.0,
         names: list[str] | None = None) -> list[dict[str, Any]]:
    """Upload every dashboard (or those named); return Grafana's answers (uid, url, version, status)."""
    api = _client(url, token, timeout)
    folder_id = ensure_folder(api, folder) if folder else None
    results = []
    for name, build in dashboards.DASHBOARDS.items():
        if names and name not in names:
            continue
        payload: dict[str, Any] = {"dashboard": dashboards.to_dict(build()), "overwrite": True, "message": MESSAGE}
        if folder_id:
            payload["folderUid"] = folder_id
        results.append(api.dashboard.update_dashboard(payload))
    return results
