"""`cs336-bench varlen`: the packed batch's lengths, the band's tile share, the smoke run end to end, the report."""

from __future__ import annotations

import pytest

from cs336_systems.bench import varlen

from .helpers import check_report, check_rows, rows_of, run_cli


def test_document_lengths_are_seeded_long_tailed_and_sum_to_the_tokens():
    lengths = varlen.document_lengths(65536, 16384, 3, seed=0)
    assert sum(lengths) == 65536 and lengths == varlen.document_lengths(65536, 16384, 3, seed=0)
    assert sum(n >= 8192 for n in lengths) == 3 and max(lengths) <= 16384
    short = [n for n in lengths if n < 8192]
    assert len(short) >= 20 and sorted(short)[len(short) // 2] < 2048  # many short documents
    assert varlen.document_lengths(65536, 16384, 3, seed=1) != lengths


def test_band_share_counts_the_tiles_the_band_meets():
    """8 x 8 causal tiles (36); a band of 128 keys meets the diagonal tile and the one left of it (1 + 2 * 7)."""
    assert varlen.band_share(1024, 128) == pytest.approx(15 / 36)
    assert varlen.band_share(1024, 10**6) == 1.0
    assert 0.12 < varlen.band_share(65536, 4096) < 0.13


def test_long_documents_that_do_not_fit_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli("varlen", "--smoke", "--tokens", "30", "--out", str(tmp_path))
    assert exc.value.code == 2 and "--long-docs" in capsys.readouterr().err


def test_smoke_varlen(tmp_path):
    """Both sections on the CPU: ours (the interpreter) ok in every mode; Flex's forward ok, its backward and the
    padded cuDNN call unsupported; ours carries ratios to the references of the same run."""
    assert run_cli("varlen", "--smoke", "--out", str(tmp_path)) == 0
    rows = rows_of(tmp_path, "varlen")
    check_rows([r for r in rows if r["impl"] != "flex"], "varlen")
    ours = [r for r in rows if r["impl"] == "flash_triton"]
    assert len(ours) == 6 and all(r["status"] == "ok" for r in ours)
    flex = {r["section"] + "/" + r["mode"]: r["status"] for r in rows if r["impl"] == "flex"}
    assert flex == {"packed/fwd": "ok", "window/fwd": "ok", "packed/fwd_bwd": "unsupported",
                    "window/fwd_bwd": "unsupported"}
    packed_fwd = next(r for r in ours if r["section"] == "packed" and r["mode"] == "fwd")
    flex_fwd = next(r for r in rows if r["impl"] == "flex" and r["section"] == "packed" and r["mode"] == "fwd")
    assert packed_fwd["x_flex"] == packed_fwd["ms"] / flex_fwd["ms"] and packed_fwd["x_padded"] is None
    window = next(r for r in ours if r["variant"] == "window" and r["mode"] == "fwd_bwd")
    causal = next(r for r in ours if r["variant"] == "causal" and r["mode"] == "fwd_bwd")
    assert window["x_causal"] == window["ms"] / causal["ms"]
    assert window["x_band"] == pytest.approx(window["x_causal"] / window["band_share"])
    table = check_report(tmp_path, "varlen", plots=False)
    assert "## Packed documents, d 16, fp32, fwd+bwd" in table and "## Sliding window 8" in table

    assert run_cli("varlen", "--smoke", "--out", str(tmp_path), "--resume") == 0
    assert len(rows_of(tmp_path, "varlen")) == len(rows)  # all done: nothing measured again

    # ours measured again (its row lost): its references are measured again beside it, so its ratios stay same-run
    path = tmp_path / "varlen" / "metrics.jsonl"
    kept = [line for line in path.read_text().splitlines()
            if not ('"impl": "flash_triton"' in line and '"section": "packed"' in line and '"mode": "fwd"' in line)]
    path.write_text("\n".join(kept) + "\n")
    assert run_cli("varlen", "--smoke", "--out", str(tmp_path), "--resume") == 0
    new = rows_of(tmp_path, "varlen")[len(kept):]
    assert sorted((r["impl"], r["mode"]) for r in new) == [("flash_triton", "fwd"), ("flex", "fwd"), ("sdpa_cudnn", "fwd")]
    again = {r["impl"]: r for r in new}
    assert again["flash_triton"]["x_flex"] == again["flash_triton"]["ms"] / again["flex"]["ms"]
    assert len({r["run_id"] for r in new}) == 1
