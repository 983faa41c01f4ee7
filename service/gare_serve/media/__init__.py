"""Media the service hands out beside the hits: signed URLs of video files and their thumbnails."""
