"""envd's ``filesystem.Filesystem`` service: ``Stat``, ``ListDir`` (with depth), ``MakeDir``,
``Move``, ``Remove``, each run in the sandbox as the requesting user (so the sandbox's own
permissions decide, as with E2B's envd) by a short POSIX shell script through
``AsyncSandbox.exec``; ``WatchDir`` and the watcher calls (``envbuild.serve.envd_watch``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import Filesystem
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from envbuild.serve import envd_watch, users
from envbuild.serve.envd_process import sandbox_of, user_of
from envbuild.serve.sandboxes import Entry, Registry

#: One line per entry: raw mode (hex) | size | owner | group | mtime | path (last: a name may
#: hold "|"; one with a newline is not supported).
_FMT = "%f|%s|%U|%G|%Y|%n"
_STAT = f"stat -c '{_FMT}' -- \"$1\""
#: ``Stat`` of a symlink adds a line: its target's raw mode (hex; 0 if none) | the target's
#: path, resolved (E2B's envd: the type and mode are the target's, ``is_symlink`` says what
#: the entry is)
_TARGET = ('if [ -L "$1" ]; then printf \'%s|%s\\n\' "$(stat -L -c %f -- "$1" 2>/dev/null || '
           'echo 0)" "$(readlink -f -- "$1" || printf %s "$1")"; fi')
#: exit codes of the scripts: 3 no such path, 4 not a directory, 5 already exists
_SCRIPTS = {
    "stat": f'[ -e "$1" ] || [ -L "$1" ] || exit 3; {_STAT} && {_TARGET}',
    "list": '[ -e "$1" ] || exit 3; [ -d "$1" ] || exit 4; '
            f"find \"$1\" -mindepth 1 -maxdepth \"$2\" -exec stat -c '{_FMT}' -- {{}} +",
    "mkdir": f'[ -e "$1" ] && exit 5; mkdir -p -- "$1" && {_STAT}',
    "move": '[ -e "$1" ] || [ -L "$1" ] || exit 3; mkdir -p -- "$(dirname -- "$2")" && '
            f'mv -f -- "$1" "$2" && set -- "$2" && {_STAT}',
    "remove": 'rm -rf -- "$1"',  # E2B: removing what is not there is no error
    "watch": '[ -e "$1" ] || exit 3; [ -d "$1" ] || exit 4; [ -r "$1" ] && [ -x "$1" ] || exit 6',
}
_ERRORS = {3: (Code.NOT_FOUND, "no such file or directory"),
           4: (Code.INVALID_ARGUMENT, "path is not a directory"),
           5: (Code.ALREADY_EXISTS, "path already exists"),
           6: (Code.PERMISSION_DENIED, "permission denied")}
MAX_DEPTH = 64


def _mode_string(mode: int) -> str:
    kinds = {0o040000: "d", 0o120000: "l", 0o100000: "-"}
    out = kinds.get(mode & 0o170000, "?")
    for shift in (6, 3, 0):
        bits = (mode >> shift) & 7
        out += ("r" if bits & 4 else "-") + ("w" if bits & 2 else "-") + ("x" if bits & 1 else "-")
    return out


def _file_type(mode: int) -> pb.FileType:
    return {0o040000: pb.FileType.DIRECTORY, 0o120000: pb.FileType.SYMLINK,
            0o100000: pb.FileType.FILE}.get(mode & 0o170000, pb.FileType.UNSPECIFIED)


def _entry_info(line: str, target: str | None = None) -> pb.EntryInfo:
    """An entry of a ``_FMT`` line; ``target``, a symlink's ``_TARGET`` line."""
    raw_mode, size, owner, group, mtime, path = line.split("|", 5)
    mode = int(raw_mode, 16)
    kind = mode & 0o170000
    info = pb.EntryInfo(name=path.rstrip("/").rsplit("/", 1)[-1] or "/", type=_file_type(mode),
                        path=path, size=int(size), mode=mode & 0o7777,
                        permissions=_mode_string(mode), owner=owner, group=group,
                        modified_time=Timestamp(seconds=int(mtime)), is_symlink=kind == 0o120000)
    if target is not None:
        raw_target, info.symlink_target = target.split("|", 1)
        target_mode = int(raw_target, 16)
        info.type, info.mode = _file_type(target_mode), target_mode & 0o7777
    return info


def _components(line: str) -> list[str]:
    """The path of a ``_FMT`` line, split: sorting by it is E2B's ``ListDir`` order (a
    directory's entries by name, each directory right before what is in it)."""
    return line.split("|", 5)[-1].split("/")


class FilesystemService(Filesystem):
    """The ``filesystem.Filesystem`` implementation (``filesystem_connect.Filesystem``)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def _run(self, ctx: RequestContext, op: str, *paths: str, extra: tuple[str, ...] = ()
                   ) -> tuple[Entry, list[str], str]:
        entry = sandbox_of(self._registry, ctx)
        user = await user_of(entry, ctx)
        args = [users.absolute(p, user) for p in paths]
        result = await entry.sandbox.exec(["/bin/sh", "-c", _SCRIPTS[op], "sh", *args, *extra],
                                          user=user.spec, timeout=60)
        if result.exit_code in _ERRORS:
            code, what = _ERRORS[result.exit_code]
            raise ConnectError(code, f"{what}: {args[0]}")
        if result.exit_code != 0:
            err = result.stderr.decode(errors="replace").strip()[-500:]
            code = Code.PERMISSION_DENIED if "denied" in err else Code.INTERNAL
            raise ConnectError(code, f"{op} {args[0]}: {err}")
        return entry, result.stdout.decode(errors="replace").splitlines(), args[0]

    async def stat(self, request: pb.StatRequest, ctx: RequestContext) -> pb.StatResponse:
        _, lines, _ = await self._run(ctx, "stat", request.path)
        return pb.StatResponse(entry=_entry_info(lines[0], lines[1] if len(lines) > 1 else None))

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext
                       ) -> pb.ListDirResponse:
        depth = min(max(request.depth or 1, 1), MAX_DEPTH)
        _, lines, _ = await self._run(ctx, "list", request.path, extra=(str(depth),))
        return pb.ListDirResponse(entries=[_entry_info(line) for line in
                                           sorted(filter(None, lines), key=_components)])

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext
                       ) -> pb.MakeDirResponse:
        _, lines, _ = await self._run(ctx, "mkdir", request.path)
        return pb.MakeDirResponse(entry=_entry_info(lines[0]))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext) -> pb.MoveResponse:
        _, lines, _ = await self._run(ctx, "move", request.source, request.destination)
        return pb.MoveResponse(entry=_entry_info(lines[0]))

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext) -> pb.RemoveResponse:
        await self._run(ctx, "remove", request.path)
        return pb.RemoveResponse()

    def watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext
                  ) -> AsyncIterator[pb.WatchDirResponse]:
        return self._watch_dir(request, ctx)

    async def _watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext
                         ) -> AsyncIterator[pb.WatchDirResponse]:
        entry, _, path = await self._run(ctx, "watch", request.path)
        watch_id, watch = await envd_watch.open_watch(entry, path, request.recursive)
        async for response in envd_watch.stream(entry, watch_id, watch):
            yield response

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: RequestContext
                             ) -> pb.CreateWatcherResponse:
        entry, _, path = await self._run(ctx, "watch", request.path)
        watch_id, _ = await envd_watch.open_watch(entry, path, request.recursive, polled=True)
        return pb.CreateWatcherResponse(watcher_id=watch_id)

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest,
                                 ctx: RequestContext) -> pb.GetWatcherEventsResponse:
        entry = sandbox_of(self._registry, ctx)
        return pb.GetWatcherEventsResponse(events=envd_watch.poll(entry, request.watcher_id))

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: RequestContext
                             ) -> pb.RemoveWatcherResponse:
        entry = sandbox_of(self._registry, ctx)
        if request.watcher_id not in entry.watchers:
            raise ConnectError(Code.NOT_FOUND, f"no watcher {request.watcher_id[:64]}")
        envd_watch.close_watch(entry, request.watcher_id)
        return pb.RemoveWatcherResponse()
