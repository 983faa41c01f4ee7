"""``GET /v1/videos/{id}`` (metadata), ``.../thumbnail`` (a cached JPEG) and ``.../file`` (the video, ranges)."""

import hashlib
import logging
import mimetypes
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from gare_index.store import IndexVersion
from gare_serve.engine.state import ServiceState
from gare_serve.media.thumbnails import make_thumbnail
from gare_serve.web.deps import StateDep, VideoId, require_media, require_search
from gare_serve.web.presentation import API_VERSION, media_urls, public_metadata
from gare_serve.web.schemas import MEDIA_ERRORS, VideoInfo

log = logging.getLogger(__name__)

router = APIRouter(tags=["videos"])


def _metadata_or_404(version: IndexVersion, video_id: int) -> dict[str, Any]:
    try:
        return version.metadata([video_id])[0]
    except KeyError:
        raise HTTPException(404, f"no video with id {video_id} in index version {version.name}") from None


def _file_or_404(state: ServiceState, version: IndexVersion, video_id: int) -> tuple[Path, dict[str, Any]]:
    meta = _metadata_or_404(version, video_id)
    p = version.path_of(video_id)  # from SQLite, never from the client
    if p is None:
        raise HTTPException(404, f"no video with id {video_id}")
    p = Path(p)
    library_root = state.settings.library_root
    if library_root is not None:
        try:
            p.resolve().relative_to(Path(library_root).resolve())
        except (ValueError, OSError):
            log.warning("video %d: %s is outside library_root; not served", video_id, p)
            raise HTTPException(404, f"the file of video {video_id} is not available") from None
    if not p.is_file():
        raise HTTPException(404, f"the file of video {video_id} is no longer available")
    return p, meta


@router.get(f"/{API_VERSION}/videos/{{video_id}}", response_model=VideoInfo, responses=MEDIA_ERRORS,
            dependencies=[Depends(require_search)], summary="metadata of one index entry")
async def video_info(video_id: VideoId, state: StateDep) -> VideoInfo:
    with state.use_version() as version:
        meta = await run_in_threadpool(_metadata_or_404, version, video_id)
        thumb, video = media_urls(state, video_id)
        return VideoInfo(
            id=video_id, index_version=version.name, metadata=public_metadata(state, meta),
            thumbnail_url=thumb, video_url=video,
        )


@router.get(f"/{API_VERSION}/videos/{{video_id}}/thumbnail", dependencies=[Depends(require_media)],
            responses={**MEDIA_ERRORS, 200: {"content": {"image/jpeg": {}}, "description": "a JPEG frame of the entry"},
                       304: {"description": "not modified (If-None-Match matched the ETag)"}},
            response_class=Response, summary="a JPEG thumbnail (middle frame of the entry), cached")
async def video_thumbnail(video_id: VideoId, request: Request, state: StateDep) -> Response:
    width = state.settings.thumbnail_width
    with state.use_version() as version:
        path, meta = await run_in_threadpool(_file_or_404, state, version, video_id)
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, meta.get("start"), meta.get("end"), width)
        etag = '"' + hashlib.sha256(repr(key).encode("utf-8")).hexdigest()[:32] + '"'
        headers = {"ETag": etag, "Cache-Control": "private, max-age=3600"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        data = state.thumbs.get(key)
        state.metrics.thumb_cache.labels("hit" if data is not None else "miss").inc()
        if data is None:
            try:
                data = await run_in_threadpool(make_thumbnail, path, meta, width)
            except Exception as e:  # noqa: BLE001 - decoder errors of every kind
                log.warning("thumbnail of video %d failed: %s", video_id, e)
                raise HTTPException(422, f"video {video_id} could not be decoded for a thumbnail") from None
            state.thumbs.put(key, data)
        return Response(data, media_type="image/jpeg", headers=headers)


@router.get(f"/{API_VERSION}/videos/{{video_id}}/file", dependencies=[Depends(require_media)],
            responses={**MEDIA_ERRORS, 200: {"description": "the whole file"}, 206: {"description": "a byte range"},
                       416: {"description": "range not satisfiable"}},
            response_class=FileResponse, summary="the video file (HTTP range requests supported)")
async def video_file(video_id: VideoId, state: StateDep) -> FileResponse:
    with state.use_version() as version:
        path, _ = await run_in_threadpool(_file_or_404, state, version, video_id)
        media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if not media.startswith("video/"):
            media = "video/mp4" if path.suffix.lower() in (".mp4", ".m4v") else media
        return FileResponse(path, media_type=media, content_disposition_type="inline", filename=path.name,
                            headers={"Cache-Control": "private, max-age=3600"})
