import io
import json

from textstats.cli import main


def test_single_file(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("hello world\nhello\n", encoding="utf-8")
    assert main([str(f)]) == 0
    assert capsys.readouterr().out.split() == ["2", "3", "18", str(f)]


def test_total_line_and_top(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x y\n", encoding="utf-8")
    b.write_text("y z\n", encoding="utf-8")
    assert main(["--top", "1", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["2", "4", "8", "total"]
    assert lines[3].split() == ["2", "y"]


def test_json_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("a b a\n"))
    assert main(["--json", "--top", "1", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == {"lines": 1, "words": 3, "chars": 6}
    assert out["top"] == [["a", 2]]


def test_missing_file(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 1
    assert "nope" in capsys.readouterr().err
