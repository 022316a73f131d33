from envbuild.errors import DefinitionError, Problem, StepFailed


def test_problem_renders_file_line_column_path_and_hint():
    p = Problem("envdefs/envs/a.yaml", 3, 5, "unknown key 'toolkit'", path="toolkit",
                hint="did you mean 'toolkits'?")
    assert p.render() == ("envdefs/envs/a.yaml:3:5: unknown key 'toolkit' (at toolkit)"
                          " — did you mean 'toolkits'?")


def test_definition_error_sorts_problems_and_counts_them():
    err = DefinitionError([Problem("b.yaml", 1, 1, "x"), Problem("a.yaml", 9, 1, "y")])
    lines = err.render_lines()
    assert lines[0].startswith("a.yaml:9:1")
    assert lines[1].startswith("b.yaml:1:1")
    assert lines[-1] == "error: 2 problems in definitions"


def test_step_failed_carries_argv_exit_code_and_tail():
    err = StepFailed("step 2 of ws failed", argv=["/bin/sh", "-c", "false"], exit_code=1,
                     output_tail="boom\n", log_path="cache/logs/x.log")
    assert err.exit_code == 1
    assert err.render_lines() == ["error: step 2 of ws failed", "boom",
                                  "hint: full log: cache/logs/x.log"]
