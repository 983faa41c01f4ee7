"""The HTTP surface: routes, their dependencies and bodies, auth, media, limits, the page."""
