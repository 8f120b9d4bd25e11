#!/usr/bin/env python3
"""Issue 18's evaluation of a trained tabular checkpoint on real scikit-learn tables.

Usage: python bench/tabular_eval.py --megatron target/release/megatron --load CKPT [--ensemble 4]
       [--parts supervised,imputation,latency]

For each table, 5 repeated 70/30 splits (seeds 0-4): `megatron tabular predict` against
scikit-learn's logistic/linear regression, random forest and HistGradientBoosting (ROC AUC,
accuracy, log loss; RMSE, R^2). Imputation: 10 % of the numeric feature cells hidden (MCAR),
`megatron tabular impute` against IterativeImputer, RMSE in units of each column's standard
deviation. Anomalies: 2 % of the feature cells replaced by another row's value of the same column
(so the marginal is unchanged and only the dependencies give them away), ROC AUC of
`megatron tabular score-anomalies` against |z|. Then the prediction latency of a 1,000-row x
20-column table. Prints Markdown tables (medians and means over splits).
"""
import argparse, os, subprocess, tempfile, time
import numpy as np
from sklearn import datasets
from sklearn.model_selection import train_test_split
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.ensemble import (RandomForestClassifier, RandomForestRegressor,
                              HistGradientBoostingClassifier, HistGradientBoostingRegressor)
from sklearn.preprocessing import StandardScaler
from sklearn.pipeline import make_pipeline
from sklearn.metrics import roc_auc_score, accuracy_score, log_loss, mean_squared_error, r2_score
from sklearn.experimental import enable_iterative_imputer  # noqa: F401
from sklearn.impute import IterativeImputer


def tables():
    out = []
    for name, loader in [("iris", datasets.load_iris), ("wine", datasets.load_wine),
                         ("breast_cancer", datasets.load_breast_cancer)]:
        d = loader()
        out.append((name, d.data, d.target, "classification"))
    d = datasets.load_diabetes()
    out.append(("diabetes", d.data, d.target, "regression"))
    # California housing needs a download (no network here): the wine table's alcohol content
    # from its other measurements is the second regression table.
    d = datasets.load_wine()
    out.append(("wine_alcohol", d.data[:, 1:], d.data[:, 0], "regression"))
    return out


def write_csv(path, X, y=None):
    cols = [f"f{i}" for i in range(X.shape[1])]
    with open(path, "w") as f:
        f.write(",".join(cols + (["target"] if y is not None else [])) + "\n")
        for i in range(X.shape[0]):
            cells = ["" if np.isnan(v) else repr(float(v)) for v in X[i]]
            if y is not None:
                cells.append(repr(int(y[i])) if float(y[i]).is_integer() else repr(float(y[i])))
            f.write(",".join(cells) + "\n")


def read_csv(path):
    with open(path) as f:
        header = f.readline().strip().split(",")
        rows = [[float(v) if v else np.nan for v in l.strip().split(",")] for l in f if l.strip()]
    return header, np.array(rows)


def run(args, *extra):
    subprocess.run([args.megatron, "tabular", *extra, "--load", args.load,
                    "--ensemble", str(args.ensemble), "--num-threads", str(args.threads)],
                   check=True, stdout=subprocess.DEVNULL)


def scores_cls(y, p, k):
    auc = roc_auc_score(y, p[:, 1]) if k == 2 else roc_auc_score(y, p, multi_class="ovr")
    return auc, accuracy_score(y, p.argmax(1)), log_loss(y, np.clip(p, 1e-15, 1), labels=list(range(k)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--ensemble", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--splits", type=int, default=5)
    ap.add_argument("--parts", default="supervised,imputation,latency",
                    help="comma-separated: supervised (predict), imputation (impute and anomaly scores), latency")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    tmp = tempfile.mkdtemp()
    print(f"checkpoint {args.load}, ensemble {args.ensemble}, {args.splits} splits\n")
    print("| table | model | ROC AUC | accuracy | log loss | RMSE | R^2 |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for name, X, y, task in (tables() if "supervised" in parts else []):
        res = {}
        for seed in range(args.splits):
            strat = y if task == "classification" else None
            Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=strat)
            tr, te, out = (os.path.join(tmp, f) for f in ("train.csv", "test.csv", "pred.csv"))
            write_csv(tr, Xtr, ytr)
            write_csv(te, Xte)
            run(args, "predict", "--train", tr, "--test", te, "--target", "target", "--out", out,
                "--task", task, "--seed", str(seed))
            _, P = read_csv(out)
            if task == "classification":
                k = len(np.unique(y))
                models = {
                    "megatron-rs": P,
                    "logistic regression": make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)).fit(Xtr, ytr).predict_proba(Xte),
                    "random forest": RandomForestClassifier(n_estimators=300, random_state=seed).fit(Xtr, ytr).predict_proba(Xte),
                    "HistGradientBoosting": HistGradientBoostingClassifier(random_state=seed).fit(Xtr, ytr).predict_proba(Xte),
                }
                for m, p in models.items():
                    res.setdefault(m, []).append(scores_cls(yte, p, k))
            else:
                models = {
                    "megatron-rs": P[:, 0],
                    "ridge regression": make_pipeline(StandardScaler(), Ridge()).fit(Xtr, ytr).predict(Xte),
                    "random forest": RandomForestRegressor(n_estimators=300, random_state=seed).fit(Xtr, ytr).predict(Xte),
                    "HistGradientBoosting": HistGradientBoostingRegressor(random_state=seed).fit(Xtr, ytr).predict(Xte),
                }
                for m, p in models.items():
                    res.setdefault(m, []).append((mean_squared_error(yte, p) ** 0.5, r2_score(yte, p)))
        for m, v in res.items():
            v = np.array(v).mean(0)
            if task == "classification":
                print(f"| {name} | {m} | {v[0]:.4f} | {v[1]:.4f} | {v[2]:.4f} | | |")
            else:
                print(f"| {name} | {m} | | | | {v[0]:.4f} | {v[1]:.4f} |")
            summary.setdefault(m, []).append(v[0] if task == "classification" else None)
    aucs = {m: np.mean([a for a in v if a is not None]) for m, v in summary.items() if any(a is not None for a in v)}
    if aucs:
        print("\nMean ROC AUC over the classification tables:", ", ".join(f"{m} {a:.4f}" for m, a in aucs.items()))

    print("\n| table | imputation RMSE (sd units): megatron-rs | IterativeImputer | anomaly ROC AUC: megatron-rs | abs z |")
    print("|---|---|---|---|---|")
    for name, X, y, task in (tables() if "imputation" in parts else []):
        imp, anom = [], []
        for seed in range(args.splits):
            rng = np.random.default_rng(seed)
            sd = X.std(0) + 1e-12
            # Imputation: 10 % of the feature cells hidden.
            mask = rng.random(X.shape) < 0.1
            Xh = X.copy(); Xh[mask] = np.nan
            path, out = os.path.join(tmp, "holes.csv"), os.path.join(tmp, "filled.csv")
            write_csv(path, Xh, y)
            run(args, "impute", "--table", path, "--target", "target", "--out", out,
                "--task", task, "--seed", str(seed))
            _, F = read_csv(out)
            ours = np.sqrt(np.mean(((F[:, :-1][mask] - X[mask]) / np.broadcast_to(sd, X.shape)[mask]) ** 2))
            full = np.column_stack([Xh, y])
            it = IterativeImputer(max_iter=25, random_state=seed).fit_transform(full)[:, :-1]
            theirs = np.sqrt(np.mean(((it[mask] - X[mask]) / np.broadcast_to(sd, X.shape)[mask]) ** 2))
            # Anomalies: 2 % of the cells take another row's value of the same column.
            bad = rng.random(X.shape) < 0.02
            Xc = X.copy()
            for i, j in zip(*np.nonzero(bad)):
                Xc[i, j] = X[rng.integers(len(X)), j]
            bad &= Xc != X
            write_csv(path, Xc, y)
            out = os.path.join(tmp, "scores.csv")
            run(args, "score-anomalies", "--table", path, "--target", "target", "--out", out,
                "--task", task, "--seed", str(seed))
            _, S = read_csv(out)
            z = np.abs((Xc - Xc.mean(0)) / (Xc.std(0) + 1e-12))
            anom.append((roc_auc_score(bad.ravel(), S[:, :-1].ravel()), roc_auc_score(bad.ravel(), z.ravel())))
            imp.append((ours, theirs))
        i, a = np.array(imp).mean(0), np.array(anom).mean(0)
        print(f"| {name} | {i[0]:.4f} | {i[1]:.4f} | {a[0]:.4f} | {a[1]:.4f} |")

    if "latency" not in parts:
        return
    # Latency: 1,000 context rows x 20 columns, 1,000 query rows.
    rng = np.random.default_rng(0)
    Xl = rng.normal(size=(2000, 20)); yl = (Xl[:, :3].sum(1) > 0).astype(int)
    tr, te, out = (os.path.join(tmp, f) for f in ("ltr.csv", "lte.csv", "lout.csv"))
    write_csv(tr, Xl[:1000], yl[:1000]); write_csv(te, Xl[1000:])
    for ens in (1, args.ensemble):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            subprocess.run([args.megatron, "tabular", "predict", "--load", args.load, "--train", tr, "--test", te,
                            "--target", "target", "--out", out, "--ensemble", str(ens), "--num-threads", str(args.threads)],
                           check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - t)
        hgb = []
        for _ in range(5):
            t = time.perf_counter()
            HistGradientBoostingClassifier().fit(Xl[:1000], yl[:1000]).predict_proba(Xl[1000:])
            hgb.append(time.perf_counter() - t)
        print(f"\nlatency, 1,000 context + 1,000 query rows x 20 columns, ensemble {ens}: megatron tabular predict "
              f"median {np.median(times):.3f} s (whole process: start, checkpoint load, CSV, forward); "
              f"HistGradientBoosting fit+predict median {np.median(hgb):.3f} s")


if __name__ == "__main__":
    main()
