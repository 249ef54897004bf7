"""Finding and reading hardware profile files.

A profile is `<name>.yaml` in one of the search directories: the user's `--profiles-dir` (if given), then the
shipped datasheet profiles (`hwprofiles/profiles/`), then measured ones written by calibration
(`hwprofiles/measured/`). A name found in two directories is an error rather than a silent override, so
that a result always says unambiguously which hardware it was simulated on.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hwprofiles.schema import HardwareProfile, ProfileError, profile_from_dict

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
MEASURED_DIR = Path(__file__).resolve().parent / "measured"
YAML_SUFFIXES = (".yaml", ".yml")


def load_profile_file(path: str | Path) -> HardwareProfile:
    """Reads and validates one YAML profile file; any problem -> ProfileError naming the file and field."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file; pass an existing .yaml file or a profile name")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read the file ({type(exc).__name__}); check it is UTF-8 text") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ProfileError(f"{path}: not valid YAML{where}: {problem}") from exc
    except RecursionError as exc:
        raise ProfileError(f"{path}: YAML nested too deeply to be a hardware profile") from exc
    profile = profile_from_dict(data, str(path))
    if profile.name != path.stem:
        raise ProfileError(f"{path}: name: {profile.name!r} differs from the file name; rename the file to "
                           f"{profile.name}{path.suffix} or set `name: {path.stem}`")
    return profile


def validate_profile_file(path: str | Path) -> HardwareProfile:
    """Same as `load_profile_file`; the name says why you call it."""
    return load_profile_file(path)


def search_dirs(profiles_dir: str | Path | None = None) -> list[Path]:
    dirs = []
    if profiles_dir is not None:
        user_dir = Path(profiles_dir)
        if not user_dir.is_dir():
            raise ProfileError(f"--profiles-dir {user_dir}: not a directory; pass a directory of <name>.yaml files")
        dirs.append(user_dir)
    dirs += [d for d in (PROFILES_DIR, MEASURED_DIR) if d.is_dir()]
    return dirs


def _profile_files(dirs: list[Path]) -> dict[str, list[Path]]:
    """Profile name (file stem) -> every file that defines it, in search order."""
    by_name: dict[str, list[Path]] = {}
    for directory in dirs:
        for path in sorted(directory.iterdir()):
            if path.suffix in YAML_SUFFIXES and path.is_file():
                known = by_name.setdefault(path.stem, [])
                if all(path.resolve() != p.resolve() for p in known):
                    known.append(path)
    return by_name


def _single(name: str, paths: list[Path]) -> Path:
    if len(paths) > 1:
        raise ProfileError(f"{paths[1]}: profile name {name!r} is also defined in {paths[0]}; rename one of them")
    return paths[0]


def load_profile(name_or_path: str | Path, profiles_dir: str | Path | None = None) -> HardwareProfile:
    """A profile by name (searched in `profiles_dir`, shipped, measured) or by path to a .yaml file."""
    text = str(name_or_path)
    if text.endswith(YAML_SUFFIXES) or "/" in text or "\\" in text:
        return load_profile_file(text)
    by_name = _profile_files(search_dirs(profiles_dir))
    if text not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        raise ProfileError(f"unknown hardware profile {text!r}; known: {known} (or pass a path to a .yaml file)")
    return load_profile_file(_single(text, by_name[text]))


def list_profiles(profiles_dir: str | Path | None = None) -> list[HardwareProfile]:
    """Every profile in the search directories, validated, sorted by name; duplicates are an error."""
    by_name = _profile_files(search_dirs(profiles_dir))
    return [load_profile_file(_single(name, paths)) for name, paths in sorted(by_name.items())]
