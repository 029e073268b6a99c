"""`load_tokenizer` never runs code from a model folder: a custom tokenizer class (`auto_map`) or a
tokenizer transformers cannot load is read from tokenizer.json with `tokenizers`, chat template kept."""
import json

import pytest

import maskahead_jax as mj
from maskahead_jax.tasks.tokenizer import BOS_ID, build_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}question : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}answer :{% endif %}")


def _folder(tmp_path, **config):
    """tokenizer.json + tokenizer_config.json (+ `config`), and a tokenizer module that leaves a marker."""
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    marker = tmp_path / "code_ran"
    (tmp_path / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "chat_template": TEMPLATE, **config}))
    return marker


@pytest.mark.parametrize("config, why", [
    ({"tokenizer_class": "EvilTokenizer",
      "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}, "auto_map"),
    ({"tokenizer_class": "NoSuchTokenizer"}, "transformers cannot load it"),
])
def test_custom_tokenizer_code_is_never_run(tmp_path, capsys, config, why):
    marker = _folder(tmp_path, **config)
    with pytest.warns(UserWarning, match=why) as record:
        tok = mj.load_tokenizer(str(tmp_path))
    assert "with the chat template" in str(record[0].message)
    assert not marker.exists()
    assert "[y/N]" not in capsys.readouterr().out  # transformers' "run the custom code?" prompt
    assert not tok.hf and tok.has_chat_template
    ids = tok.encode_prompt("the pass key is 42")
    assert ids[0] == BOS_ID and tok.decode(ids) == "question : the pass key is 42 answer :"
    assert ids[1:] == tok.encode("question : the pass key is 42 answer :", add_special_tokens=False)


def test_custom_tokenizer_without_tokenizer_json_is_an_error(tmp_path):
    marker = _folder(tmp_path, auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="auto_map.*no tokenizer.json"):
        mj.load_tokenizer(str(tmp_path))
    assert not marker.exists()


def test_missing_folder_is_an_error_not_the_testbed_tokenizer(tmp_path):
    """A mistyped path used to give the testbed tokenizer silently; a folder with no tokenizer
    files still falls back to it, with a warning."""
    from maskahead_jax.evaluation.datasets import load_tokenizer

    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        load_tokenizer(str(tmp_path / "typo"))
    with pytest.warns(UserWarning, match="holds no tokenizer"):
        assert load_tokenizer(str(tmp_path)).name == "testbed"
