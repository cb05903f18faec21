"""Building and starting a task's environment without a container engine: image-lite root filesystems, the build
network, stand-in stages, the image's user, attempts in an image, helper services, container images for engines,
and the offline toolchain.

Rule: may read ``harbor/``; ``harbor/`` never imports this folder.
"""
