"""Run one page's examples in order, like a notebook: ``python docs_runner.py PAGE WORKDIR``.

tests/test_docs_pages.py starts it, one fresh interpreter per page; docs_blocks.py says how
each block is run and how the marks work. Prints one line per block; at the first failure it
prints ``FAILED PAGE:LINE: ...`` with the traceback or the differing output and exits 1 (later
blocks build on earlier ones, so they are not run).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
import traceback

import docs_blocks
from docs_blocks import Block

COMMAND_TIMEOUT = 120.0


class Failed(Exception):
    pass


class Runner:
    def __init__(self, page: str, work: str):
        self.page = docs_blocks.parse(page)
        self.work = work
        self.names: dict = {"__name__": "__main__", "__file__": os.path.join(work, "example.py")}
        self.last_stdout: str | None = None
        self.s3 = None

    @property
    def env(self) -> dict[str, str]:
        """The environment of shell blocks: this process's (setup code may set variables), with this
        interpreter's scripts (the ``tensorcanon`` command) first on PATH, and no COLUMNS."""
        bindir = os.path.dirname(sys.executable)
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        env.pop("COLUMNS", None)
        return env

    # -- one block -------------------------------------------------------------------------------
    def run(self, block: Block) -> str:
        if block.skip_reason:
            return f"skipped ({block.skip_reason})"
        if block.lang in docs_blocks.PYTHON and "python" in self.page.run_by:
            return f"run by {self.page.run_by['python']}"
        for mark in block.marks:
            if mark.keyword == "files":
                src = os.path.join(docs_blocks.ROOT, mark.arg)
                shutil.copytree(src, self.work, dirs_exist_ok=True)
            elif mark.keyword == "needs":
                self.start(mark)
        setup = block.mark("setup")
        if setup:
            self.exec_python(setup.body, setup.body_line, block, "its setup comment")
        if block.lang in docs_blocks.PYTHON:
            self.last_stdout = self.exec_python(block.code, block.code_line, block, "the block")
            return "ran"
        if block.lang in docs_blocks.SHELL:
            self.shell(block)
            return "ran"
        if block.lang in docs_blocks.CONSOLE:
            self.console(block)
            return "ran, output compared"
        if block.mark("output"):
            if self.last_stdout is None:
                raise Failed("an 'output' block follows no Python block that ran")
            self.compare(block.code.split("\n"), self.last_stdout.split("\n"),
                         "what the Python block before it printed")
            return "output compared"
        if setup:
            return "setup ran"
        return "not code"

    def exec_python(self, code: str, line: int, block: Block, what: str) -> str:
        compiled = compile("\n" * (line - 1) + code, os.path.join(docs_blocks.ROOT, block.page), "exec")
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compiled, self.names)
        except BaseException:  # noqa: BLE001 (SystemExit and KeyboardInterrupt in an example fail it too)
            raise Failed(f"{what} raised (the traceback's lines are the page's):\n"
                         f"{traceback.format_exc()}\nwhat it printed:\n{out.getvalue()}") from None
        sys.stdout.write(out.getvalue())
        return out.getvalue()

    def shell(self, block: Block) -> None:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=self.work, env=self.env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT)
        if proc.returncode != 0:
            raise Failed(f"bash exited with {proc.returncode}:\n{proc.stdout}")

    def console(self, block: Block) -> None:
        for offset, command, expected in docs_blocks.console_commands(block.code):
            proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=self.work, env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=COMMAND_TIMEOUT)
            where = f"{block.page}:{block.code_line + offset}"
            if not any(line.strip() for line in expected) and proc.returncode != 0:
                raise Failed(f"{where}: `{command}` exited with {proc.returncode} (the page shows no output, "
                             f"so it must succeed):\n{proc.stdout}")
            self.compare(expected, proc.stdout.split("\n"), f"the output of `{command}` (line {where})")

    @staticmethod
    def compare(expected: list[str], actual: list[str], what: str) -> None:
        if not docs_blocks.matches(expected, actual):
            exp = "\n".join(expected).strip("\n")
            act = "\n".join(actual).strip("\n")
            raise Failed(f"{what} differs from the page ('...' matches anything):\n"
                         f"--- the page shows\n{exp}\n--- it printed\n{act}")

    # -- services ----------------------------------------------------------------------------------
    def start(self, mark) -> None:
        service, *buckets = mark.arg.split()
        if service != "s3":
            raise Failed(f"line {mark.line}: unknown service {service!r} (known: s3)")
        if self.s3 is None:
            import logging
            import socket

            import s3fs
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            self.s3.start()
            for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                               ("AWS_DEFAULT_REGION", "us-east-1")):
                os.environ[key] = value
            self.names["S3_ENDPOINT"] = f"http://127.0.0.1:{port}"
            self.fs = s3fs.S3FileSystem(endpoint_url=self.names["S3_ENDPOINT"])
        for bucket in buckets:
            if not self.fs.exists(bucket):
                self.fs.mkdir(bucket)

    def stop(self) -> None:
        if self.s3 is not None:
            self.s3.stop()


def main(page: str, work: str) -> int:
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    runner = Runner(page, work)
    started = time.perf_counter()
    try:
        for block in runner.page.blocks:
            try:
                verdict = runner.run(block)
            except Failed as e:
                print(f"FAILED {block.where} ({block.lang or 'no language'}): {e}", flush=True)
                return 1
            except subprocess.TimeoutExpired as e:
                print(f"FAILED {block.where}: `{e.cmd}` ran over {COMMAND_TIMEOUT:.0f} s", flush=True)
                return 1
            print(f"{block.where} [{block.lang or 'no language'}]: {verdict} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
    finally:
        runner.stop()
    print(f"{page}: every example passed", flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # DataLoader workers, moto's threads: nothing left to finalize
