"""One answer to "is this model name a hub repository?" for every room that asks (servetune.models.names)."""

from servetune.models.names import is_hub_id, looks_like_hub_id


def test_the_form_org_slash_name_is_a_hub_id_and_paths_are_not():
    assert looks_like_hub_id("meta-llama/Llama-3.1-8B")
    for name in ("tiny", "./org/name", "/models/org", "~/org/name", "org/", "/name", "a/b/c"):
        assert not looks_like_hub_id(name), name


def test_a_folder_on_this_machine_is_not_a_hub_id_as_given_or_under_the_space_folder(tmp_path, monkeypatch):
    assert is_hub_id("org/model", tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not is_hub_id("org/model", tmp_path)  # relative to the space file's folder
    assert is_hub_id("org/model")  # relative to nothing: the working directory has no such folder
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/model")  # as given, from the working directory
