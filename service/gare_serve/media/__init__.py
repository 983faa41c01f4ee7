"""Media the service hands out beside the hits: signed URLs of video files (``signing``) and the thumbnails of
index entries with their cache (``thumbnails``)."""
