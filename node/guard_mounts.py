"""Which host paths reach a node's MPS folder: the guard's test of a container's mounts on an MPS node.

A mount is compared by the real host path it names, not by its text: every symlink resolved (/var/run is
one, to /run), and every place where the host's own mount table (/proc/self/mountinfo) shows the folder or
a part of it again (a bind of it, of a folder above it, or a Docker volume made of such a bind). A source
reaches the folder when it is one of those places, lies inside one, or contains one (/run, /).
The host's /proc reaches it too: /proc/<pid>/root shows any process's mounts.
Loaded by gpu_guard.py on MPS nodes only, like guard_efa.py; posix only, as it runs inside a create.
"""

import posix

_TYPE, _LINK = 0o170000, 0o120000
_MAX_LINKS = 40  # as the kernel's walk (ELOOP)


def real(path: str) -> str:
    """path with each symlink resolved as the kernel walks it, absolute and without . or ..; the part
    that does not exist is kept as written (dockerd creates a missing bind source before the container)."""
    todo = [p for p in reversed(path.split("/")) if p]
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop()
        if part == ".":
            continue
        if part == "..":
            done = done[:-1]
            continue
        here = "/" + "/".join(done + [part])
        try:
            # /proc's magic links (/proc/<pid>/root) are not followed: /proc itself is what reaches too far
            is_link = done[:1] != ["proc"] and posix.lstat(here).st_mode & _TYPE == _LINK
        except OSError:
            is_link = False  # not there (or not readable): taken as written
        if not is_link:
            done.append(part)
            continue
        links += 1
        if links > _MAX_LINKS:
            raise OSError(f"{path}: more than {_MAX_LINKS} symlinks")
        target = posix.readlink(here)
        if target.startswith("/"):
            done = []
        todo.extend(p for p in reversed(target.split("/")) if p)
    return "/" + "/".join(done)


def under(path: str, folder: str) -> bool:
    """path is folder or lies inside it (both real)."""
    return folder == "/" or path == folder or path.startswith(folder + "/")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in octal (\\040)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_table(path: str = "/proc/self/mountinfo") -> list[tuple[str, str, str]]:
    """(device, root inside its filesystem, mount point) of each mount, in the order mounted."""
    table = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) > 4:
                table.append((fields[2], _unescape(fields[3]), _unescape(fields[4])))
    return table


def places(folder: str, table: list[tuple[str, str, str]]) -> list[str]:
    """Every host path that shows the real folder or a part of it: its own, and each mount of its filesystem
    whose root lies above it (the folder shows below that mount point) or inside it (a part shows there)."""
    holder = None
    for mount in table:  # the last mount on the longest point that holds it is what a walk reaches
        if under(folder, mount[2]) and (holder is None or len(mount[2]) >= len(holder[2])):
            holder = mount
    if holder is None:
        return [folder]
    device, root, point = holder
    inside = (root.rstrip("/") + folder[len(point.rstrip("/")):]) or "/"  # the folder's path in its filesystem
    found = [folder]
    for dev, mount_root, mount_point in table:
        if dev != device:
            continue
        if under(inside, mount_root):
            rest = inside[len(mount_root.rstrip("/")):]
            found.append((mount_point.rstrip("/") + rest) or "/")
        elif under(mount_root, inside):
            found.append(mount_point)
    return sorted(set(found))


def reaches(source: str, folder_places: list[str]) -> bool:
    """A real source path reaches the folder: it is one of its places, lies inside one, or contains one;
    or it is the host's /proc, whose /proc/<pid>/root shows every process's mounts."""
    return under(source, "/proc") or any(under(source, p) or under(p, source) for p in folder_places)
