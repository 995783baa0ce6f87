"""Run one script many times as `python SCRIPT ARGUMENTS...` runs it, for the cost of one start-up: the libraries
(torch, transformers, deepspeed and the modules) are imported once, then each run is a forked process that
executes the script as __main__ with its own sys.argv, stdout and stderr. For the runs that end before any model
loads (--help, bad input), where importing takes nearly all of a run's 5-8 s.

python tests/forked_runs.py SCRIPT '[[ARGUMENTS...], ...]' OUTPUT [validate | checks] writes, as JSON into OUTPUT,
each run's {"returncode", "stdout", "stderr", "seconds"}. With `validate`, a run parses its arguments and calls the
script's validate() (its argument checks) instead of main(): 0 where they pass. With `checks`, a run is main() up to
the loading of its first model (the process group, the DeepSpeed config as DeepSpeed reads it, the dataset's rows):
MODELS_LOAD (3) where every check before it passes."""

import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback


MODELS_LOAD = 3


def models_load(*args, **kwargs):
    sys.exit(MODELS_LOAD)


def run_as_main(script, arguments, mode):
    """In a child process: run `script` as `python script arguments...` would (or only its checks: `mode`); returns its
    exit code."""
    sys.argv = [script, *arguments]
    if mode == "checks":
        sys.modules["data"].load_model = models_load  # the script imports it from data as it runs
    try:
        if mode == "validate":
            module = sys.modules[script[:-3]]
            args = module.parse_arguments(module.Args)
            args.world_size = 1
            module.validate(args)
        else:
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:  # sys.exit(2), tyro's usage errors, --help
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def main():
    script, cases, output = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "main"
    sys.argv = [script]  # as the script's own process has it when its modules are imported
    sys.path.insert(0, os.getcwd())
    importlib.import_module(script[:-3])
    results = []
    for arguments in cases:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            started = time.time()
            pid = os.fork()
            if pid == 0:
                os.setsid()  # its own process group: vLLM's engine processes are stopped with it
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                code = run_as_main(script, arguments, mode)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.time() - started > 300:  # a run that gets past its checks (to train) is stopped
                    os.killpg(pid, signal.SIGKILL)
                time.sleep(0.02)
            seconds = time.time() - started
            out.seek(0)
            err.seek(0)
            results.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(),
                            "stderr": err.read().decode(), "seconds": seconds})
    with open(output, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
