//! The crate's layout stays a house of floors: every top-level module of `src/` (a file or a
//! folder) imports, through `crate::` paths outside unit tests, only modules of its own floor
//! or of floors below; modules of one floor never import each other in a circle; and no file
//! is longer than 700 lines before its unit tests. A newcomer finds each concept by its floor.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The floors, lowest first; each lists its top-level modules.
const FLOORS: &[(&str, &[&str])] = &[
    ("foundations", &["error", "sync", "clock", "arith"]),
    (
        "model",
        &[
            "limit",
            "calendar",
            "quota",
            "key",
            "rejection",
            "remaining",
            "failure",
            "fields",
            "batch",
            "credit",
            "stats",
            "metrics",
        ],
    ),
    ("pure state machines", &["bucket", "lease", "slots"]),
    ("stores", &["local", "global"]),
    ("engine", &["call_queue", "throttle", "in_flight"]),
    ("answers", &["response"]),
    (
        "tower surface",
        &[
            "policy",
            "future",
            "service",
            "layer",
            "builder",
            "metered",
            "concurrency",
        ],
    ),
];

const MAX_LINES: usize = 700;

fn floor_of(module: &str) -> Option<usize> {
    FLOORS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to.
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).expect("a file under src/");
    let first = relative
        .components()
        .next()
        .expect("a path")
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    first.trim_end_matches(".rs").to_owned()
}

/// The code of a file before its unit tests, without comment lines (doc links are not
/// imports).
fn code_before_tests(text: &str) -> (usize, String) {
    let code = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    let lines = code.lines().count();
    let without_comments = code
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    (lines, without_comments)
}

/// The names `crate::NAME` refers to in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    code.match_indices("crate::")
        .filter(|(at, _)| {
            let before = code[..*at].chars().next_back();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$')
        })
        .map(|(at, _)| {
            code[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// Names re-exported at the crate root, with the module they come from.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = lib;
    while let Some(at) = rest.find("pub use ") {
        rest = &rest[at + "pub use ".len()..];
        let end = rest.find(';').unwrap_or(rest.len());
        let item = &rest[..end];
        let module: String = item
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let names = item.rsplit("::").next().unwrap_or_default();
        for name in names.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if name.starts_with(|c: char| c.is_ascii_uppercase()) {
                out.insert(name.to_owned(), module.clone());
            }
        }
    }
    out
}

#[test]
fn every_module_imports_only_its_floor_or_those_below_and_files_stay_short() {
    // The crate beside this suite.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../src");
    let lib = fs::read_to_string(src.join("lib.rs")).expect("src/lib.rs");
    let reexports = root_reexports(&lib);
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut problems = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        if module == "lib" {
            continue;
        }
        let text = fs::read_to_string(file).expect("a readable source file");
        let (lines, code) = code_before_tests(&text);
        if lines > MAX_LINES {
            problems.push(format!(
                "{} has {lines} lines before its unit tests (at most {MAX_LINES})",
                file.display()
            ));
        }
        let Some(floor) = floor_of(&module) else {
            problems.push(format!(
                "module `{module}` is on no floor: add it to FLOORS"
            ));
            continue;
        };
        for name in crate_paths(&code) {
            let target = match name.starts_with(|c: char| c.is_ascii_uppercase()) {
                true => reexports.get(&name).cloned().unwrap_or(name),
                false => name,
            };
            if target == module {
                continue;
            }
            let Some(target_floor) = floor_of(&target) else {
                continue;
            };
            if target_floor > floor {
                problems.push(format!(
                    "{} (floor {}: {}) imports `{target}` from the floor above ({})",
                    file.display(),
                    floor,
                    FLOORS[floor].0,
                    FLOORS[target_floor].0
                ));
            }
            edges.entry(module.clone()).or_default().insert(target);
        }
    }
    // Circles within a floor: a module reaching itself.
    for start in edges.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<&String> = edges[start].iter().collect();
        while let Some(next) = stack.pop() {
            if next == start {
                problems.push(format!("`{start}` imports itself through a circle"));
                break;
            }
            if seen.insert(next.clone()) {
                stack.extend(edges.get(next).into_iter().flatten());
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
