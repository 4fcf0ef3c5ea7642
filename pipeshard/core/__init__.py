"""The bottom layer's helpers: errors, atomic files, sizes, the version. Imports nothing of the project."""
